"""The whole stack as local processes on embedded defaults: `bcstack up` / `bcstack down`.

    info = up(Path(".bcstack"), worker="expert")   # builds what is missing, starts, waits for health
    down(Path(".bcstack"))                         # stops every process (SIGTERM, then SIGKILL)

What `up` builds under the state directory when it is missing: the toy world (`world/`), the tiny
model (`tiny/`) and the retrieval index (`index/`). What it starts, each its own process group
with its log in `logs/`: retrieval, the engine (the scripted expert, the untrained tiny model, or
a checkpoint folder), the worker, the scripted coordinator LLM, the coordinator gateway and the
judge (rule). `stack.json` (DESIGN.md §8) records every service's URLs and pid; `admin-token`
(mode 0600) holds the admin token the services share. A second `up` while a stack runs refuses.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

TRAIN_DIR = "train"  # RL runs of this stack: the worker reloads exports from here
STATE_FILE = "stack.json"
TOKEN_FILE = "admin-token"
DEFAULT_PORTS = {
    "retrieval": (8001, 50051),
    "engine": (30000, None),
    "worker": (8002, 50052),
    "coordinator-llm": (8004, None),
    "coordinator": (8003, 50053),
    "judge": (8005, 50055),
}
START_ORDER = tuple(DEFAULT_PORTS)  # dependencies first; `down` stops in reverse


class StackError(RuntimeError):
    """Something `up`/`down` cannot do; the message is one line for the user."""


@dataclass
class Service:
    name: str
    args: list[str]
    http_port: int
    grpc_port: int | None
    env: dict[str, str] = field(default_factory=dict)
    pid: int | None = None

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def grpc(self) -> str | None:
        return f"127.0.0.1:{self.grpc_port}" if self.grpc_port is not None else None


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _pick_port(preferred: int | None, taken: set[int]) -> int:
    """The preferred port when it is free, else one the OS picks."""
    if preferred is not None and preferred not in taken and _port_free(preferred):
        taken.add(preferred)
        return preferred
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in taken:
            taken.add(port)
            return port


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_state(state: Path) -> dict[str, Any] | None:
    path = state / STATE_FILE
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise StackError(f"{path} is unreadable ({e}); remove it after checking no stack runs") from None


def running_pids(info: dict[str, Any]) -> dict[str, int]:
    return {
        name: s["pid"] for name, s in info.get("services", {}).items() if s.get("pid") and _alive(s["pid"])
    }


def ensure_assets(
    state: Path,
    *,
    docs: int,
    seed: int,
    questions_per_tier: int,
    say: Callable[[str], None],
    train_questions: tuple[int, int] = (100, 50),
) -> dict[str, Path]:
    """The toy world, the tiny model and the index under `state`, built when missing.

    `train_questions` is the toy train split (medium, hard) made with a new world.
    """
    from devkit.modelkit.build import build_tiny_kit
    from devkit.toyworld.generator import ToyWorldError, generate_world, write_world

    world, tiny, index = state / "world", state / "tiny", state / "index"
    if not (world / "corpus.jsonl").is_file():
        say(
            f"building the toy world ({docs:,} documents, {questions_per_tier} test questions per tier) "
            f"in {world}"
        )
        medium, hard = train_questions
        try:
            made = generate_world(
                docs, seed, questions_per_tier=questions_per_tier, train_medium=medium, train_hard=hard
            )
        except ToyWorldError as e:
            raise StackError(f"cannot build the toy world: {e}") from None
        write_world(made, world)
    if not (tiny / "config.json").is_file():
        say(f"building the tiny Qwen3 model in {tiny}")
        build_tiny_kit(tiny, corpus_path=world / "corpus.jsonl", seed=seed)
    if not (index / "manifest.json").is_file() or _index_incomplete(index):
        say(f"indexing the corpus into {index}")
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "bcstack",
                "index",
                "--corpus",
                str(world / "corpus.jsonl"),
                "--index-dir",
                str(index),
            ],
            check=False,
        )
        if result.returncode != 0:
            raise StackError(f"indexing failed (exit {result.returncode}); see the output above")
    return {"world": world, "tiny": tiny, "index": index}


def _index_incomplete(index: Path) -> bool:
    try:
        manifest = json.loads((index / "manifest.json").read_text())
    except (OSError, json.JSONDecodeError):
        return True
    return not manifest.get("complete")


def plan(state: Path, assets: dict[str, Path], worker: str, token: str) -> list[Service]:
    """The services `up` starts, with their command lines and ports."""
    taken: set[int] = set()
    ports = {
        name: (_pick_port(h, taken), _pick_port(g, taken) if g else None)
        for name, (h, g) in DEFAULT_PORTS.items()
    }
    tiny = assets["tiny"]
    if worker == "expert":
        engine_args = ["--policy", "expert", "--tokenizer", str(tiny), "--world", str(assets["world"])]
        tokenizer = tiny
    elif worker == "tiny":
        engine_args, tokenizer = ["--model", str(tiny)], tiny
    else:
        checkpoint = Path(worker)
        if not (checkpoint / "config.json").is_file():
            raise StackError(f"--worker {worker}: not expert, tiny or a model folder with config.json")
        engine_args, tokenizer = ["--model", str(checkpoint)], checkpoint
    env = {"BCSTACK_ADMIN_TOKEN": token}

    def svc(name: str, args: list[str]) -> Service:
        http, grpc_port = ports[name]
        full = ["serve", name, *args, "--port", str(http)]
        if grpc_port is not None:
            full += ["--grpc-port", str(grpc_port)]
        return Service(name, full, http, grpc_port, env=dict(env))

    retrieval = svc("retrieval", ["--index-dir", str(assets["index"])])
    engine = svc("engine", engine_args)
    worker_svc = svc(
        "worker",
        [
            "--tokenizer",
            str(tokenizer),
            "--engine-url",
            engine.http,
            "--retrieval",
            retrieval.grpc or "",
            # `bcstack train rl --state` writes its exports under STATE/train; the worker reloads them.
            "--checkpoint-root",
            str(state / TRAIN_DIR),
        ],  # fmt: skip
    )
    llm = svc("coordinator-llm", ["--policy", "scripted"])
    gateway = svc(
        "coordinator",
        [
            "--coordinator-url", f"{llm.http}/v1",
            "--workers", worker_svc.grpc or "",
            "--records", str(state / "records.sqlite"),
        ],
    )  # fmt: skip
    judge = svc("judge", ["--cache", str(state / "judge-cache.sqlite")])
    return [retrieval, engine, worker_svc, llm, gateway, judge]


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _tail(path: Path, chars: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def up(
    state: Path,
    *,
    worker: str = "expert",
    docs: int = 2000,
    seed: int = 0,
    questions_per_tier: int = 50,
    train_questions: tuple[int, int] = (100, 50),
    timeout: float = 300.0,
    say: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Build what is missing, start every service, wait until all are healthy; return stack.json's content."""
    state = state.resolve()
    state.mkdir(parents=True, exist_ok=True)
    info = read_state(state)
    if info is not None:
        alive = running_pids(info)
        if alive:
            listed = ", ".join(f"{n} (pid {p})" for n, p in alive.items())
            raise StackError(
                f"a stack is already running from {state}: {listed}; run `bcstack down --state {state}`"
            )
        (state / STATE_FILE).unlink()
    assets = ensure_assets(
        state,
        docs=docs,
        seed=seed,
        questions_per_tier=questions_per_tier,
        say=say,
        train_questions=train_questions,
    )
    token_path = state / TOKEN_FILE
    if not token_path.is_file():
        token_path.write_text(secrets.token_urlsafe(24) + "\n")
        token_path.chmod(0o600)
    token = token_path.read_text().strip()
    (state / TRAIN_DIR).mkdir(exist_ok=True)
    services = plan(state, assets, worker, token)
    logs = state / "logs"
    logs.mkdir(exist_ok=True)
    started: list[Service] = []
    try:
        for service in services:
            log = (logs / f"{service.name}.log").open("w")
            proc = subprocess.Popen(
                [sys.executable, "-m", "bcstack", *service.args],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **service.env},
                start_new_session=True,  # its own process group: `down` stops it and its children
            )
            log.close()
            service.pid = proc.pid
            started.append(service)
            _write_state(state, started, worker)
            deadline = time.monotonic() + timeout
            while not _healthy(service.http):
                if proc.poll() is not None:
                    raise StackError(
                        f"{service.name} exited with {proc.returncode}; the end of its log "
                        f"({logs / (service.name + '.log')}):\n" + _tail(logs / f"{service.name}.log")
                    )
                if time.monotonic() > deadline:
                    raise StackError(f"{service.name} was not healthy within {timeout:.0f} s; see {logs}")
                time.sleep(0.2)
            say(f"  {service.name:16s} {service.http}" + (f"  gRPC {service.grpc}" if service.grpc else ""))
    except BaseException:
        _stop(started)
        (state / STATE_FILE).unlink(missing_ok=True)
        raise
    return _write_state(state, started, worker)


def _write_state(state: Path, services: list[Service], worker: str) -> dict[str, Any]:
    info = {
        "worker": worker,
        "state": str(state),
        "admin_token_file": str(state / TOKEN_FILE),
        "services": {s.name: {"http": s.http, "grpc": s.grpc, "pid": s.pid} for s in services},
    }
    tmp = state / (STATE_FILE + ".tmp")
    tmp.write_text(json.dumps(info, indent=2) + "\n")
    os.replace(tmp, state / STATE_FILE)
    return info


def _stop(services: list[Service] | list[int], grace: float = 20.0) -> list[int]:
    """SIGTERM each process group (last started first), SIGKILL what outlives `grace`; the pids killed."""
    pids = [s.pid if isinstance(s, Service) else s for s in reversed(services)]
    pids = [p for p in pids if p]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for pid in pids:
        while _alive(pid) and time.monotonic() < deadline:
            _reap(pid)
            time.sleep(0.1)
    killed = []
    for pid in pids:
        if _alive(pid):
            try:
                os.killpg(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
        _reap(pid)
    return killed


def _reap(pid: int) -> None:
    # Our own child (up and down in one process) would otherwise linger as a zombie.
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def down(state: Path, *, say: Callable[[str], None] = print) -> int:
    """Stop the stack started from `state`; the number of services stopped."""
    state = state.resolve()
    info = read_state(state)
    if info is None:
        raise StackError(f"no stack was started from {state} (no {STATE_FILE})")
    alive = running_pids(info)
    order = [alive[name] for name in START_ORDER if name in alive]
    killed = _stop(order)
    for name in alive:
        say(f"  stopped {name} (pid {alive[name]})" + (" with SIGKILL" if alive[name] in killed else ""))
    (state / STATE_FILE).unlink(missing_ok=True)
    return len(alive)
