"""The seed-004 specialists on the CPU, end to end: two toy domains, a base, a LoRA GRPO specialist
per domain, a student distilled from both (MOPD), and the cross-domain pass@1 table.

    python bench/specialists.py [--work DIR] [--rl-steps 30] [--distill-steps 20] [--results FILE]
                                [--dirty-ok]

Every step is the stack's own command, run as a user would run it:

1. `bcstack toyworld math --domain arithmetic|sequence` (1,600 train / 64 dev / 200 test prompts each,
   held out by content: no problem's numbers and operations are in two splits; arithmetic has only
   1,944 distinct problems, so --train + 64 + --test must stay within that);
2. `bcstack model tiny --corpus` both domains' corpora (a tokenizer that knows their words; width 128,
   4 layers), then the base: `bcstack train sft` on both domains' worked replies, where three replies in
   four end in "The answer is N." instead of the requested "Answer: N" line (the verifier reads only
   the latter), as a base model that half-follows a requested answer format does;
3. per domain, `bcstack train grpo --env math` from the base against a CPU engine serving it (LoRA
   rank 16, alpha 32 on attention, MLP and lm_head; group-centred advantages, clip [0.8, 1.2], no KL;
   the engine hot-reloaded with the merged policy after every update), ending in a merged BF16 export
   that `bcstack checkpoint verify` accepts;
4. `bcstack train distill` of the base from the two specialists (each prompt routed to its domain's
   teacher, per-token reverse KL on the student's own samples);
5. `bcstack eval passk` of all four models on both test splits (4 samples, T 0.7, top-p 0.8, top-k 20),
   paired 95% intervals against the base; the "Claims" table says, for each specialist on its own
   domain and the student on both, whether the interval lies above zero.

The learning rates are the CPU's, not the seed's 1e-5: with LoRA on the 0.87M-parameter model, a
probe at 1e-4 left the greedy development score where it was after 40 updates, so the runs take 1e-3
(`--rl-lr`, `--distill-lr`). `--format-share 0` makes a base that already writes the requested answer
line, to see what RL does to the skill itself. A killed run resumes: a stage whose output exists
is skipped. Results, with the command, commit, machine and each stage's seconds, go to
bench/results/specialists.md (--results); refused from a checkout with uncommitted changes
unless --dirty-ok (the report then says DIRTY).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

from common import Table, free_port, print_machine, process, require_clean_tree, write_results  # noqa: E402

from devkit.toyworld.domains import write_mixed_format_sft  # noqa: E402

DOMAINS = ("arithmetic", "sequence")
ADMIN = "bench-specialists"


def bcstack(*args: str, log: Path) -> None:
    with log.open("w") as out:
        done = subprocess.run(
            [sys.executable, "-m", "bcstack", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "BCSTACK_ADMIN_TOKEN": ADMIN},
        )
    if done.returncode != 0:
        tail = log.read_text(errors="replace").strip().splitlines()[-3:]
        raise SystemExit(f"bcstack {' '.join(args[:2])} failed (exit {done.returncode}): {' | '.join(tail)}")


LENIENT_ANSWER = re.compile(r"(?:^Answer:|The answer is)\s*(-?\d+)", re.MULTILINE)


def format_table(work: Path, results: dict) -> Table:
    """What the gains are made of: the requested format's share, and accuracy in either format.

    "Right in either format" reads the last "Answer: N" or "The answer is N" (the base's other
    format); the verifier reads only the first; its Δ has the same paired interval as pass@1's.
    A model gains pass@1 by following the format more often (the requested share up, either-format
    accuracy flat) or by answering right more often (either-format accuracy up).
    """
    labels = {}
    for d in DOMAINS:
        for line in (work / d / "test.jsonl").read_text().splitlines():
            row = json.loads(line)
            labels[(d, row["id"])] = int(row["label"])
    from bcstack.evaluation.passk import paired_bootstrap

    stats: dict[tuple[str, str], list[int]] = {}
    per_prompt: dict[tuple[str, str], dict[str, list[int]]] = {}
    for line in (work / "passk" / "responses.jsonl").read_text().splitlines():
        r = json.loads(line)
        found = LENIENT_ANSWER.findall(r["text"])
        right = bool(found) and int(found[-1]) == labels[(r["benchmark"], r["prompt_id"])]
        cell = stats.setdefault((r["model"], r["benchmark"]), [0, 0, 0])
        cell[0] += 1
        cell[1] += bool(re.search(r"^Answer:", r["text"], re.MULTILINE))
        cell[2] += right
        per_prompt.setdefault((r["model"], r["benchmark"]), {}).setdefault(r["prompt_id"], []).append(right)
    rows = []
    for m in results["models"]:
        for b in results["benchmarks"]:
            n, req, ok = stats[(m, b)]
            mine, base = per_prompt[(m, b)], per_prompt[(results["baseline"], b)]
            diffs = [sum(mine[q]) / len(mine[q]) - sum(base[q]) / len(base[q]) for q in sorted(base)]
            lo, hi = paired_bootstrap(diffs)
            rows.append(
                [m, b, results["cells"][m][b]["pass_at_1"], 100 * req / n, 100 * ok / n,
                 100 * sum(diffs) / len(diffs), 100 * lo, 100 * hi]
            )  # fmt: skip
    return Table(
        "What the gains are made of (percent of sampled responses)",
        [
            "model",
            "benchmark",
            "pass@1 (verifier)",
            "requested 'Answer:' format",
            "right in either format",
            "Δ either-format pp vs base",
            "CI low",
            "CI high",
        ],
        rows,
        notes=[format_table.__doc__.split("\n\n")[1].replace("\n    ", " ").strip()],
    )


def claims_table(results: dict) -> Table:
    """The learning claims, which a benchmark reports rather than a test asserts (STYLE.md): each
    LoRA GRPO specialist raises held-out pass@1 on its own domain, and the distilled student raises
    it on both; a claim holds when the paired 95% interval against the base lies above zero."""
    claims = [(f"{d}-specialist", d, "LoRA GRPO raises held-out pass@1 on its domain") for d in DOMAINS]
    claims += [("MOPD-student", d, "distillation from both specialists raises the student") for d in DOMAINS]
    rows = []
    for model, bench, claim in claims:
        vs = results["cells"].get(model, {}).get(bench, {}).get("vs_baseline") or {}
        low, high = vs.get("ci_pp", [None, None])
        verdict = "holds" if low is not None and low > 0 else "not shown"
        rows.append([claim, model, bench, vs.get("delta_pp"), low, high, verdict])
    return Table(
        "Claims",
        ["claim", "model", "benchmark", "Δ pp vs base", "CI low", "CI high", "verdict"],
        rows,
        notes=["holds: the paired 95% interval of the pass@1 difference from the base is above zero."],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=None, help="Working folder (default: a temporary one).")
    parser.add_argument(
        "--train",
        type=int,
        default=1600,
        help="Training prompts per domain (default 1600: arithmetic has 1,944 distinct problems for "
        "train + 64 dev + test; runs before DOMAINS_VERSION 2 used 2000).",
    )
    parser.add_argument("--test", type=int, default=200, help="Held-out test prompts per domain.")
    parser.add_argument("--sft-epochs", type=float, default=3.0)
    parser.add_argument(
        "--format-share",
        type=float,
        default=0.75,
        help="Share of the base's SFT replies in the unrequested format.",
    )
    parser.add_argument("--rl-steps", type=int, default=30)
    parser.add_argument("--rl-lr", type=float, default=1e-3)
    parser.add_argument("--prompts-per-step", type=int, default=32)
    parser.add_argument("--distill-steps", type=int, default=20)
    parser.add_argument("--distill-lr", type=float, default=1e-3)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--results", type=Path, default=None)
    parser.add_argument("--dirty-ok", action="store_true", help="write the report from uncommitted changes")
    args = parser.parse_args()
    require_clean_tree("specialists", args.dirty_ok)  # before the run, not after it
    print_machine()
    work = args.work or Path(tempfile.mkdtemp(prefix="bcstack-specialists-"))
    work.mkdir(parents=True, exist_ok=True)
    logs = work / "logs"
    logs.mkdir(exist_ok=True)
    seconds_file = work / "seconds.json"
    seconds: dict[str, float] = json.loads(seconds_file.read_text()) if seconds_file.exists() else {}

    class stage:
        """Times a stage and keeps its seconds in WORK/seconds.json."""

        def __init__(self, name: str) -> None:
            self.name = name

        def __enter__(self) -> None:
            self.t = time.perf_counter()
            print(f"[{self.name}] …", flush=True)

        def __exit__(self, kind, exc, tb) -> None:
            if kind is None:
                seconds[self.name] = round(time.perf_counter() - self.t, 1)
                seconds_file.write_text(json.dumps(seconds, indent=2))
                print(f"[{self.name}] {seconds[self.name]} s", flush=True)

    def done_before(name: str, marker: Path) -> bool:
        """A stage whose output exists is not run again: a killed run resumes where it stopped."""
        if marker.exists():
            print(f"[{name}] done before ({marker}); skipped", flush=True)
            return True
        return False

    if not done_before("domains", work / DOMAINS[-1] / "manifest.json"):
        with stage("domains"):
            for d in DOMAINS:
                bcstack(
                    "toyworld",
                    "math",
                    "--domain",
                    d,
                    "--out",
                    str(work / d),
                    "--train",
                    str(args.train),
                    "--test",
                    str(args.test),
                    "--force",
                    log=logs / f"domain-{d}.log",
                )
    if not done_before("kit", work / "kit" / "config.json"):
        with stage("kit"):
            corpus = work / "corpus.jsonl"
            corpus.write_text("".join((work / d / "corpus.jsonl").read_text() for d in DOMAINS))
            bcstack(
                "model",
                "tiny",
                "--out",
                str(work / "kit"),
                "--corpus",
                str(corpus),
                "--hidden-size",
                "128",
                "--layers",
                "4",
                "--vocab-size",
                "1024",
                "--force",
                log=logs / "kit.log",
            )
    if not done_before("base SFT", work / "base" / "serving" / "SHA256SUMS"):
        with stage("base SFT"):
            write_mixed_format_sft(
                [work / d / "sft.jsonl" for d in DOMAINS], work / "base-sft.jsonl", args.format_share
            )
            bcstack(
                "train",
                "sft",
                "--model",
                str(work / "kit"),
                "--source",
                f"both={work / 'base-sft.jsonl'}",
                "--out",
                str(work / "base"),
                "--lr",
                "3e-3",
                "--min-lr",
                "3e-4",
                "--epochs",
                str(args.sft_epochs),
                log=logs / "base-sft.log",
            )
    base = work / "base" / "serving"
    specialists = {}
    for d in DOMAINS:
        if not done_before(f"RL {d}", work / f"rl-{d}" / "summary.json"):
            with stage(f"RL {d}"):
                port = free_port()
                env_log = logs / f"engine-rl-{d}.log"
                os.environ["BCSTACK_ADMIN_TOKEN"] = ADMIN
                with process(
                    ["serve", "engine", "--model", str(base), "--port", str(port)],
                    f"http://127.0.0.1:{port}/health_generate",
                    env_log,
                ):
                    bcstack(
                        "train",
                        "grpo",
                        "--env",
                        "math",
                        "--model",
                        str(base),
                        "--engine",
                        f"http://127.0.0.1:{port}",
                        "--prompts",
                        str(work / d / "train.jsonl"),
                        "--dev-prompts",
                        str(work / d / "dev.jsonl"),
                        "--out",
                        str(work / f"rl-{d}"),
                        "--steps",
                        str(args.rl_steps),
                        "--prompts-per-step",
                        str(args.prompts_per_step),
                        "--max-response-tokens",
                        str(args.max_new_tokens),
                        "--lr",
                        str(args.rl_lr),
                        "--warmup-updates",
                        "2",
                        "--eval-every",
                        "10",
                        log=logs / f"rl-{d}.log",
                    )
        specialists[d] = work / f"rl-{d}" / "serving"
    if not done_before("distill", work / "student" / "summary.json"):
        with stage("distill"):
            mixed = work / "mixed-train.jsonl"
            mixed.write_text("".join((work / d / "train.jsonl").read_text() for d in DOMAINS))
            teachers = work / "teachers.json"
            teachers.write_text(
                json.dumps(
                    {
                        "enable_thinking": False,
                        "teachers": {d: {"model": str(p)} for d, p in specialists.items()},
                    }
                )
            )
            port = free_port()
            with process(
                ["serve", "engine", "--model", str(base), "--port", str(port)],
                f"http://127.0.0.1:{port}/health_generate",
                logs / "engine-distill.log",
            ):
                bcstack(
                    "train",
                    "distill",
                    "--teachers",
                    str(teachers),
                    "--model",
                    str(base),
                    "--engine",
                    f"http://127.0.0.1:{port}",
                    "--prompts",
                    str(mixed),
                    "--out",
                    str(work / "student"),
                    "--steps",
                    str(args.distill_steps),
                    "--prompts-per-step",
                    str(args.prompts_per_step),
                    "--responses",
                    "2",
                    "--max-response-tokens",
                    str(args.max_new_tokens),
                    "--lr",
                    str(args.distill_lr),
                    "--warmup-updates",
                    "2",
                    log=logs / "distill.log",
                )
    if not done_before("pass@k", work / "passk" / "results.json"):
        with stage("pass@k"):
            models = [
                f"base={base}",
                *(f"{d}-specialist={p}" for d, p in specialists.items()),
                f"MOPD-student={work / 'student' / 'serving'}",
            ]
            bcstack(
                "eval",
                "passk",
                *(x for m in models for x in ("--model", m)),
                *(x for d in DOMAINS for x in ("--prompts", f"{d}={work / d / 'test.jsonl'}")),
                "--samples",
                str(args.samples),
                "--max-response-tokens",
                str(args.max_new_tokens),
                "--baseline",
                "base",
                "--out",
                str(work / "passk"),
                log=logs / "passk.log",
            )
    results = json.loads((work / "passk" / "results.json").read_text())
    rows = []
    for model in results["models"]:
        for bench in results["benchmarks"]:
            c = results["cells"][model][bench]
            vs = c.get("vs_baseline") or {}
            ci = vs.get("ci_pp", [None, None])
            rows.append(
                [
                    model,
                    bench,
                    c["prompts"],
                    c["samples"],
                    c["pass_at_1"],
                    c["pass_at_k"].get(str(args.samples)),
                    vs.get("delta_pp"),
                    ci[0],
                    ci[1],
                    vs.get("wilcoxon_p"),
                    c["response_tokens_mean"],
                    c.get("length_ratio"),
                ]
            )
    tables = [
        claims_table(results),
        Table(
            "Cross-domain pass@1 (the seed's shape)",
            ["model", *(f"{b} pass@1" for b in results["benchmarks"])],
            [
                [m, *(results["cells"][m][b]["pass_at_1"] for b in results["benchmarks"])]
                for m in results["models"]
            ],
        ),
        Table(
            "Per cell",
            [
                "model",
                "benchmark",
                "prompts",
                "samples",
                "pass@1",
                f"pass@{args.samples}",
                "Δ pp vs base",
                "CI low",
                "CI high",
                "Wilcoxon p",
                "response tokens",
                "length ratio",
            ],
            rows,
            notes=["Δ: paired per-prompt pass@1 difference from the base, BCa bootstrap over prompts (95%)."],
        ),
        format_table(work, results),
        Table("Stage seconds", ["stage", "seconds"], [[k, v] for k, v in seconds.items()]),
    ]
    path = write_results("specialists", tables, {"work": str(work)}, args.results, dirty_ok=args.dirty_ok)
    # The plot beside the report (docs/guide/specialists.md shows it): pass@1 with the paired intervals.
    plot = path.with_suffix(".png")
    shutil.copyfile(work / "passk" / "passk.png", plot)
    print((work / "passk" / "table.md").read_text())
    print(f"wrote {path} and {plot}")


if __name__ == "__main__":
    main()
