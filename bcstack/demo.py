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
5. The stack again with an untrained tiny model as the worker (one replica per core), over 10
   questions of each tier, with the worker settings and budget the trained checkpoint below was
   trained and evaluated with (the speedrun's: 8 turns, one branch, no gold answer to the worker).
6. `bcstack worker reload` hot-reloads the trained tiny worker committed in demo/trained-tiny (the
   RL model of a `make speedrun` run, verified against its SHA256SUMS before anything starts and
   again by the reload) into the running workers, and the same questions run again. The weights
   change, the tokenizer stays (as in SGLang), so the untrained kit is built with the
   checkpoint's shape and tokenizer (bcstack.demo_checkpoint).
7. The expert's seed-001 table, the trained model's paired with the untrained one, the PNGs, the
   /metrics URLs; then `bcstack down`.

    python -m bcstack.demo [--state .bcstack-demo] [--sample-per-tier 10] [--replicas N]
"""

from __future__ import annotations

import argparse
import json
import os
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
from bcstack.demo_checkpoint import DemoCheckpoint, DemoCheckpointError, build_untrained_kit, load
from bcstack.evaluation.cli import run_with_progress
from bcstack.evaluation.loaders import TIERS, EvalQuestion, load_questions
from bcstack.evaluation.report import build_report, render_markdown, write_report
from bcstack.speedrun import default_replicas
from bcstack.stack import TOKEN_FILE, StackError, down, read_state, sigterm_runs_finally, up


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


def reload_worker(state: Path, info: dict, trained: DemoCheckpoint) -> None:
    """`bcstack worker reload` of the packaged checkpoint into every worker of the running stack.

    The workers load only from inside their checkpoint root (STATE/train), so the checkpoint is
    copied there first; the CLI verifies it again (SHA256SUMS, layout) before any replica reloads.
    """
    from bcstack.stack import TRAIN_DIR, base_name

    target = state / TRAIN_DIR / trained.version
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(trained.folder, target)
    workers = [s["http"] for name, s in info["services"].items() if base_name(name) == "worker"]
    command = [sys.executable, "-m", "bcstack", "worker", "reload", "--checkpoint", str(target.resolve())]
    command += ["--workers", ",".join(workers), "--weight-version", trained.version, "--timeout", "120"]
    env = {**os.environ, "BCSTACK_ADMIN_TOKEN": (state / TOKEN_FILE).read_text().strip()}
    if subprocess.run(command, env=env).returncode != 0:
        raise StackError("the hot reload of demo/trained-tiny failed (its output is above)")


def main(argv: list[str] | None = None) -> int:
    # SIGTERM (kill, timeout, a scheduler) stops the demo's stack as Ctrl-C does
    with sigterm_runs_finally():
        return _main(argv)


def _main(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--state", type=Path, default=Path(".bcstack-demo"), help="working folder (kept)")
    parser.add_argument("--docs", type=int, default=2000, help="toy world documents")
    parser.add_argument(
        "--sample-per-tier",
        type=int,
        default=10,
        help="questions per tier for the untrained and the trained tiny model (50: all 150)",
    )
    parser.add_argument(
        "--tiny-max-tokens",
        type=int,
        default=None,
        help="tiny worker's episode token budget (default: the one the trained checkpoint was trained and "
        "evaluated with, its provenance.json's)",
    )
    parser.add_argument(
        "--tiny-max-turns",
        type=int,
        default=None,
        help="tiny worker's turns per episode (default: as trained)",
    )
    parser.add_argument(
        "--replicas",
        type=int,
        default=default_replicas(),
        help="tiny worker replicas (default: one per core, at most 4)",
    )
    parser.add_argument("--concurrency", type=int, default=16, help="episodes in flight")
    args = parser.parse_args(argv)
    state: Path = args.state
    t0 = time.monotonic()
    try:  # before anything starts: the checkpoint the demo reloads must be complete and untouched
        trained = load()
    except DemoCheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    results = {name: state / f"eval-{name}" for name in ("expert", "tiny", "trained")}
    backup: subprocess.Popen | None = None
    try:
        if (info := read_state(state)) is not None and info.get("services"):
            down(state, say=lambda s: None)  # a demo interrupted earlier left its stack running
        for path in [*results.values(), state / "loadtest"]:
            shutil.rmtree(path, ignore_errors=True)

        _stage(
            "1/7 the stack with the scripted expert worker (builds the toy world, tiny model, indexes)", t0
        )
        info = up(state, worker="expert", docs=args.docs, questions_per_tier=50)
        questions = load_questions(state / "world" / "questions.jsonl")
        urls = {name: s["http"] for name, s in info["services"].items()}

        at = len(questions) // 3
        _stage(
            f"2/7 evaluation: expert worker, all {len(questions)} test questions; after {at}, "
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

        _stage("3/7 retrieval load test: 5 s closed loop, 8 in flight (bcstack loadtest retrieval)", t0)
        loadtest = [sys.executable, "-m", "bcstack", "loadtest", "retrieval", "--url", urls["retrieval"]]
        loadtest += ["--concurrency", "8", "--duration", "5", "--quiet", "--out", str(state / "loadtest")]
        if subprocess.run(loadtest).returncode != 0:
            raise StackError("the retrieval load test failed (its output is above)")

        _stage("4/7 the episode viewer", t0)
        first = runs[0]
        print(
            f"episode {first['episode_id']} (question {first['query_id']}), turn by turn: "
            f"{urls['coordinator']}/ui/episodes/{first['episode_id']}\n"
            f"every episode, with filters: {urls['coordinator']}/ui  (served while the stack runs; "
            f"`bcstack up --state {state}` brings it back after the demo, or "
            f"`bcstack episodes show {first['episode_id']} --state {state}` prints it)"
        )
        down(state, say=lambda s: None)

        picked = sample(questions, args.sample_per_tier)
        which = (
            f"all {len(picked)} test questions"
            if len(picked) == len(questions)
            else f"a sample of {len(picked)} questions (the first {args.sample_per_tier} of each tier)"
        )
        tiny_budget = trained.budget
        if args.tiny_max_tokens is not None:
            tiny_budget["max_tokens"] = args.tiny_max_tokens
        if args.tiny_max_turns is not None:
            tiny_budget["max_turns"] = args.tiny_max_turns
        _stage(
            f"5/7 evaluation: untrained tiny model, {which}; worker budget {tiny_budget['max_tokens']} "
            f"tokens / {tiny_budget['max_turns']} turns, one branch per question, no gold answer to the "
            "worker (the speedrun's evaluation settings)",
            t0,
        )
        kit = build_untrained_kit(trained, state / "tiny-kit")
        info = up(
            state, worker="tiny", kit=kit, worker_settings=trained.worker_settings, replicas=args.replicas
        )
        urls = {name: s["http"] for name, s in info["services"].items()}
        tiny_eval = dict(
            concurrency=args.concurrency, overrides={"max_branches": 1}, budget=tiny_budget, worker_gold=False
        )
        run_with_progress(
            picked, results["tiny"], urls["coordinator"], urls["judge"], label="untrained", **tiny_eval
        )

        _stage(
            f"6/7 hot reload: `bcstack worker reload` puts the trained tiny worker ({trained.version}, "
            "demo/trained-tiny) into the running workers; the same questions again",
            t0,
        )
        print(f"demo/trained-tiny: {trained.describe()}")
        reload_worker(state, info, trained)
        run_with_progress(
            picked, results["trained"], urls["coordinator"], urls["judge"], label="trained", **tiny_eval
        )

        _stage("7/7 results", t0)
        expert = build_report(results["expert"])
        write_report(expert, results["expert"], name="Scripted expert worker")
        print(render_markdown(expert, name="Scripted expert worker"))
        untrained = build_report(results["tiny"])
        write_report(untrained, results["tiny"], name="Untrained tiny model")
        tuned = build_report(results["trained"], baseline_dir=results["tiny"])
        write_report(
            tuned, results["trained"], name="Trained tiny model", baseline_name="Untrained tiny model"
        )
        print(
            f"\nThe trained tiny model ({which}), paired with the untrained one on the same questions "
            "(same budget, same stack, weights swapped by the hot reload):\n"
        )
        print(render_markdown(tuned, name="Trained tiny model", baseline_name="Untrained tiny model"))
        print(
            f"\nPNG: {results['expert'] / 'report.png'}  and  {results['trained'] / 'report.png'}; load "
            f"test: {state / 'loadtest' / 'latency.png'}"
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
