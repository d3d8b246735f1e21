"""`make demo`: the main job on embedded defaults, start to finish, on one CPU machine.

1. `bcstack up` with the scripted expert worker: builds the toy world (2,000 documents, 150 test
   questions: 50 easy, 50 medium, 50 hard), the tiny Qwen3 model and the indexes when missing,
   and starts retrieval, the engine, the worker, the scripted coordinator LLM, the coordinator
   gateway and the rule-based judge as processes.
2. An evaluation round over all 150 questions with the expert worker; a third of the way through,
   `bcstack coordinator swap` moves the gateway to a second coordinator LLM endpoint (another
   stand-in process, serving another model id) while episodes are in flight: the round must end
   with every question answered and none failed, the episodes split between the two endpoints.
3. A 5-second closed-loop load test of the retrieval service (`bcstack loadtest retrieval`): its
   table, report.json and latency PNG.
4. The episode viewer's URL for one recorded episode (the gateway's /ui).
5. The stack again with the untrained tiny model as the worker, over the same 150 questions. An
   untrained model writes until its budget runs out, and the tiny model decodes a few hundred
   tokens per second per sequence on this CPU (the CPU engine batches 16), so this round runs
   with a small worker budget and one branch per question: as many tokens as the expert's longest
   trajectory (so a perfect model would fit), 8 turns; the output says so. It answers none of
   them, so 10 questions of each tier show that as well as 50 would, in a fifth of the time
   (`--sample-per-tier 50` for all 150).
6. Both seed-001 tables, the paired comparison on the sampled questions, the PNGs, the
   /metrics URLs; then `bcstack down`.

    python -m bcstack.demo [--state .bcstack-demo] [--sample-per-tier 10] [--tiny-max-tokens N]
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

from bcstack.coordinator_cli import SwapFailed, put_change, wait_for_replicas
from bcstack.evaluation.cli import run_with_progress
from bcstack.evaluation.loaders import TIERS, EvalQuestion, load_questions
from bcstack.evaluation.report import build_report, render_markdown, write_report
from bcstack.stack import TOKEN_FILE, StackError, down, read_state, up
from core import budget
from trainer.data import longest_trajectory


def sample(questions: list[EvalQuestion], per_tier: int) -> list[EvalQuestion]:
    """The first `per_tier` questions of each tier, in file order."""
    taken = {tier: 0 for tier in TIERS}
    chosen = []
    for q in questions:
        if q.tier in taken and taken[q.tier] < per_tier:
            taken[q.tier] += 1
            chosen.append(q)
    return chosen


def _stage(text: str, t0: float) -> None:
    print(f"\n== {text}  [{time.monotonic() - t0:5.0f} s]", flush=True)


BACKUP = "backup"  # the endpoint the demo swaps to, and the model id its stand-in serves
BACKUP_MODEL = "backup-coordinator"


def start_backup_llm(state: Path) -> tuple[subprocess.Popen, str]:
    """A second stand-in coordinator LLM (`bcstack serve coordinator-llm`) on a free port, serving
    another model id; (its process, its /v1 base URL) once /health answers."""
    with socket.socket() as s:  # a port the OS picks, free now
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = (state / "logs").resolve()
    log.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "bcstack", "serve", "coordinator-llm", "--policy", "scripted"]
    command += ["--model-name", BACKUP_MODEL, "--port", str(port), "--host", "127.0.0.1"]
    with open(log / "coordinator-llm-backup.log", "ab") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, f"{url}/v1"
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise StackError(f"the backup coordinator LLM did not start; see {log / 'coordinator-llm-backup.log'}")


class MidwaySwap:
    """Swaps the gateway to the backup endpoint once `at` questions are graded, from a thread of its
    own (the evaluation's event loop must not wait on it); `bcstack coordinator swap`'s own calls."""

    def __init__(self, gateway: str, token: str, base_url: str, at: int) -> None:
        self.gateway, self.token, self.base_url, self.at = gateway, token, base_url, at
        self.started = threading.Event()
        self.done_at: int | None = None
        self.error: str | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def after_each(self, graded: int) -> None:
        if graded >= self.at and not self.started.is_set():
            self.started.set()
            self.done_at = graded
            self.thread.start()

    def _run(self) -> None:
        change = {
            "activate": BACKUP,
            "endpoint": {"name": BACKUP, "base_url": self.base_url, "model": BACKUP_MODEL},
        }
        try:
            _, answer = put_change([self.gateway], change, self.token, wait=30, say=lambda _: None)
            ok, _ = wait_for_replicas([self.gateway], BACKUP, int(answer.get("version") or 0), wait=30)
            if not ok:
                self.error = "the gateway did not adopt the backup endpoint within 30 s"
        except SwapFailed as exc:
            self.error = str(exc)


def run_files(out: Path) -> list[dict]:
    """The evaluation's BrowseComp-Plus run files (one per question and round)."""
    return [json.loads(p.read_text()) for p in sorted((out / "runs").rglob("*.json"))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--state", type=Path, default=Path(".bcstack-demo"), help="working folder (kept)")
    parser.add_argument("--docs", type=int, default=2000, help="toy world documents")
    parser.add_argument(
        "--sample-per-tier",
        type=int,
        default=10,
        help="questions per tier for the untrained tiny model (50: all 150; it answers none, and each "
        "takes about 9 s of the 2 cores)",
    )
    parser.add_argument(
        "--tiny-max-tokens",
        type=int,
        default=None,
        help="tiny worker's episode token budget (default: the expert's longest trajectory, rounded up "
        "to 64)",
    )
    parser.add_argument("--tiny-max-turns", type=int, default=8, help="tiny worker's turns per episode")
    parser.add_argument("--concurrency", type=int, default=16, help="episodes in flight")
    args = parser.parse_args(argv)
    state: Path = args.state
    t0 = time.monotonic()
    results = {name: state / f"eval-{name}" for name in ("expert", "tiny")}
    backup: subprocess.Popen | None = None
    try:
        if (info := read_state(state)) is not None and info.get("services"):
            down(state, say=lambda s: None)  # a demo interrupted earlier left its stack running
        for path in [*results.values(), state / "loadtest"]:
            shutil.rmtree(path, ignore_errors=True)

        _stage(
            "1/6 the stack with the scripted expert worker (builds the toy world, tiny model, indexes)", t0
        )
        info = up(state, worker="expert", docs=args.docs, questions_per_tier=50)
        questions = load_questions(state / "world" / "questions.jsonl")
        urls = {name: s["http"] for name, s in info["services"].items()}

        at = len(questions) // 3
        _stage(
            f"2/6 evaluation: expert worker, all {len(questions)} test questions; after {at}, "
            f"`bcstack coordinator swap {BACKUP}` moves the gateway to a second coordinator LLM",
            t0,
        )
        token = (state / TOKEN_FILE).read_text().strip()
        try:  # a demo stopped mid-swap left its swap in the record store, which the gateway adopted
            put_change([urls["coordinator"]], {"activate": "default"}, token, wait=30, say=lambda _: None)
        except SwapFailed as exc:
            raise StackError(f"the gateway refused its own endpoint 'default': {exc}") from None
        backup, backup_url = start_backup_llm(state)
        swap = MidwaySwap(urls["coordinator"], token, backup_url, at)
        run_with_progress(
            questions, results["expert"], urls["coordinator"], urls["judge"], concurrency=args.concurrency,
            label="expert", after_each=swap.after_each,
        )  # fmt: skip
        if swap.started.is_set():
            swap.thread.join(timeout=60)
        runs = run_files(results["expert"])
        by_endpoint = Counter(run.get("endpoint") or "?" for run in runs)
        failed = [run for run in runs if run.get("status") == "error" or run.get("error")]
        if swap.error:
            raise StackError(f"the endpoint swap failed: {swap.error}")
        print(
            f"swap to '{BACKUP}' ({backup_url}) requested after {swap.done_at} of {len(questions)} "
            "questions; episodes per endpoint: "
            + ", ".join(f"{name} {n}" for name, n in sorted(by_endpoint.items()))
            + f"; failed episodes: {len(failed)}"
        )
        if failed:
            raise StackError(
                f"{len(failed)} episode(s) failed around the swap, e.g. {failed[0].get('error')!r}"
            )
        # The swap is kept in the record store (every replica, and a restarted one, adopts it): back to
        # the stack's own endpoint before the backup stand-in stops.
        try:
            put_change([urls["coordinator"]], {"activate": "default"}, token, wait=30, say=lambda _: None)
        except SwapFailed as exc:
            raise StackError(f"the swap back to 'default' failed: {exc}") from None
        print("swapped back to 'default' (a swap is stored: a gateway that restarts adopts it)")
        backup.terminate()

        _stage("3/6 retrieval load test: 5 s closed loop, 8 in flight (bcstack loadtest retrieval)", t0)
        loadtest = [sys.executable, "-m", "bcstack", "loadtest", "retrieval", "--url", urls["retrieval"]]
        loadtest += ["--concurrency", "8", "--duration", "5", "--quiet", "--out", str(state / "loadtest")]
        if subprocess.run(loadtest).returncode != 0:
            raise StackError("the retrieval load test failed (its output is above)")

        _stage("4/6 the episode viewer", t0)
        first = runs[0]
        print(
            f"episode {first['episode_id']} (question {first['query_id']}), turn by turn: "
            f"{urls['coordinator']}/ui/episodes/{first['episode_id']}\n"
            f"every episode, with filters: {urls['coordinator']}/ui  (served while the stack runs; "
            f"`bcstack up --state {state}` brings it back after the demo, or "
            f"`bcstack episodes show {first['episode_id']} --state {state}` prints it)"
        )
        down(state, say=lambda s: None)
        longest, _ = longest_trajectory(state / "records.sqlite")
        if args.tiny_max_tokens is None:
            # A perfect tiny model must fit: the budget is the expert's longest trajectory, not a guess.
            args.tiny_max_tokens = -(-longest // 64) * 64

        picked = sample(questions, args.sample_per_tier)
        which = (
            f"all {len(picked)} test questions"
            if len(picked) == len(questions)
            else f"a sample of {len(picked)} questions (the first {args.sample_per_tier} of each tier)"
        )
        _stage(
            f"5/6 evaluation: untrained tiny model, {which}; worker budget {args.tiny_max_tokens} tokens / "
            f"{args.tiny_max_turns} turns and one branch per question, not seed 001's "
            f"{budget.MAX_TOKENS:,} tokens / {budget.MAX_TURNS} turns: an untrained model spends its "
            "whole budget, too slow for a CPU demo",
            t0,
        )
        info = up(state, worker="tiny")
        urls = {name: s["http"] for name, s in info["services"].items()}
        run_with_progress(
            picked,
            results["tiny"],
            urls["coordinator"],
            urls["judge"],
            concurrency=args.concurrency,
            overrides={"max_branches": 1},
            budget={"max_tokens": args.tiny_max_tokens, "max_turns": args.tiny_max_turns},
            label="tiny",
        )

        _stage("6/6 results", t0)
        expert = build_report(results["expert"])
        write_report(expert, results["expert"], name="Scripted expert worker")
        print(render_markdown(expert, name="Scripted expert worker"))
        tiny = build_report(results["tiny"], baseline_dir=results["expert"])
        write_report(
            tiny, results["tiny"], name="Untrained tiny model", baseline_name="Scripted expert worker"
        )
        print(
            f"\nThe untrained tiny model ({which}, budget {args.tiny_max_tokens} tokens), paired with the "
            "expert on the same questions:\n"
        )
        print(render_markdown(tiny, name="Untrained tiny model", baseline_name="Scripted expert worker"))
        print(
            f"\nPNG: {results['expert'] / 'report.png'}  and  {results['tiny'] / 'report.png'}; load test: "
            f"{state / 'loadtest' / 'latency.png'}"
        )
        print("Metrics while the stack runs (Prometheus text):")
        for name, url in urls.items():
            print(f"  {name:16s} {url}/metrics")
        print(
            f"Episode records: {urls['coordinator']}/v1/episodes/<episode_id>; "
            f"run files under {state}/eval-*/runs"
        )
    except StackError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if backup is not None and backup.poll() is None:
            backup.terminate()
            backup.wait(timeout=30)
        if read_state(state) is not None:
            _stage("bcstack down", t0)
            down(state)
    print(f"\ndemo finished in {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
