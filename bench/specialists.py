"""The seed-004 specialists on the CPU, end to end: two toy domains, a base, a LoRA GRPO specialist
per domain, a student distilled from both (MOPD), and the cross-domain pass@1 table.

    python bench/specialists.py [--work DIR] [--rl-steps 30] [--distill-steps 20] [--results FILE]

Every step is the stack's own command, run as a user would run it:

1. `bcstack toyworld math --domain arithmetic|sequence` (2,000 train / 64 dev / 200 test prompts each);
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
   paired 95% intervals against the base.

The learning rates are the CPU's, not the seed's: a 1.6M-parameter model with LoRA on 16-ish prompts
per update moves nowhere at the seed's 1e-5 in minutes (`--rl-lr`, `--distill-lr`). Results, with the
command, commit, machine and each stage's seconds, go to bench/results/specialists.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from common import Table, free_port, print_machine, process, write_results  # noqa: E402

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=None, help="Working folder (default: a temporary one).")
    parser.add_argument("--train", type=int, default=2000)
    parser.add_argument("--test", type=int, default=200)
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
    args = parser.parse_args()
    print_machine()
    work = args.work or Path(tempfile.mkdtemp(prefix="bcstack-specialists-"))
    work.mkdir(parents=True, exist_ok=True)
    logs = work / "logs"
    logs.mkdir(exist_ok=True)
    seconds: dict[str, float] = {}

    def stage(name: str):
        class _T:
            def __enter__(self):
                self.t = time.perf_counter()
                print(f"[{name}] …", flush=True)

            def __exit__(self, *exc):
                seconds[name] = round(time.perf_counter() - self.t, 1)
                print(f"[{name}] {seconds[name]} s", flush=True)

        return _T()

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
    with stage("distill"):
        mixed = work / "mixed-train.jsonl"
        mixed.write_text("".join((work / d / "train.jsonl").read_text() for d in DOMAINS))
        teachers = work / "teachers.json"
        teachers.write_text(
            json.dumps(
                {"enable_thinking": False, "teachers": {d: {"model": str(p)} for d, p in specialists.items()}}
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
            "--max-new-tokens",
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
        Table("Stage seconds", ["stage", "seconds"], [[k, v] for k, v in seconds.items()]),
    ]
    path = write_results("specialists", tables, {"work": str(work)}, args.results)
    print((work / "passk" / "table.md").read_text())
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
