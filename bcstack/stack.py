"""The whole stack as local processes on embedded defaults: `bcstack up` / `bcstack down`.

    info = up(Path(".bcstack"), worker="expert")   # builds what is missing, starts, waits for health
    down(Path(".bcstack"))                         # stops every process (SIGTERM, then SIGKILL)

What `up` builds under the state directory when it is missing: the toy world (`world/`), the tiny
model (`tiny/`) and the retrieval index (`index/`). An existing world, tiny kit or index given with
`world=`, `kit=`, `index=` is used as it is: checked, never rebuilt or written to. What it starts,
each its own process group with its log in `logs/`: retrieval, the engine (the scripted expert, the
untrained tiny model, or a checkpoint folder), the worker, the scripted coordinator LLM, the
coordinator gateway and the judge (rule); with `records_backend="postgres"` first a PostgreSQL
server of the stack's own, and with `gateways=N` N gateways on it behind one HAProxy front whose
URL is stack.json's "gateway" (`gateway_url`; bcstack/stack_gateways.py). `worker_settings=` /
`engine_settings=` (setting name -> value) reach those two as their `bcstack serve` options,
checked against their settings classes before anything starts. `stack.json` (DESIGN.md §8) records
every service's URLs, pid and command line, the assets and the settings given; `admin-token` (mode
0600) holds the admin token the services share. A second `up` while a stack runs refuses.
`restart(state, name)` starts one service again on its ports (stopping it first when it still
runs): what an operator does after a crash, and what the kill-during-evaluation test does to each
service in turn.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import inspect
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping
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
# Each worker replica is an engine and a worker sidecar (as in the chart's worker pods): the first is
# "engine" / "worker", the others "engine-2" / "worker-2", ... on ports the OS picks. Gateway replicas
# (`--gateways N`, on one PostgreSQL) are "coordinator", "coordinator-2", ... the same way.
REPLICATED = ("engine", "worker", "coordinator")
RECORDS_BACKENDS = ("sqlite", "postgres")  # as the chart's coordinator.records.backend
FRONT = "front"  # the HAProxy in front of several gateways, in stack.json's services


def replica_name(service: str, replica: int) -> str:
    """`engine`, `engine-2`, ...: the name of replica `replica` (1-based) of a replicated service."""
    return service if replica == 1 else f"{service}-{replica}"


def base_name(name: str) -> str:
    """The service a stack.json name runs: `worker-2` -> `worker`."""
    head, _, tail = name.rpartition("-")
    return head if head in REPLICATED and tail.isdigit() else name


def _start_rank(name: str) -> tuple[int, str]:
    """Where a stack.json name comes in the start order (replicas beside their first)."""
    base = base_name(name)
    return (START_ORDER.index(base) if base in START_ORDER else len(START_ORDER), name)


def gateway_url(info: dict[str, Any]) -> str | None:
    """The one URL the apps send episodes to: the front over several gateways, else the gateway."""
    return info.get("gateway") or (info.get("services") or {}).get("coordinator", {}).get("http")


def worker_urls(info: dict[str, Any]) -> list[str]:
    """Every worker replica's HTTP URL in a stack.json, in replica order (the reload targets)."""
    names = [n for n in info.get("services", {}) if base_name(n) == "worker"]
    return [info["services"][n]["http"] for n in sorted(names, key=lambda n: (n != "worker", n))]


DENSE_CHOICES = ("edge", "none")  # the embedded dense backends `up` can build an index with
# Settings `plan` gives these services itself (ports, the services they talk to, the assets): a
# second value would silently fight it, so `worker_settings` / `engine_settings` refuse them.
MANAGED_SETTINGS = {
    "worker": ("port", "grpc_port", "engine_url", "retrieval_address", "tokenizer", "checkpoint_root"),
    "engine": ("port", "model", "tokenizer", "policy", "world"),
}


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
    """Running (a zombie is not: it has exited and waits for a parent that is not us to reap it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no procfs: signal 0 is all we can tell
    return stat[stat.rfind(")") + 2 :].split(" ", 1)[0] != "Z"


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


@functools.cache
def _serve_options(service: str) -> tuple[type, dict[str, str]]:
    """The settings class of `bcstack serve <service>` and each setting's option, as its command has them."""
    if service == "worker":
        from services.worker.cli import serve
        from services.worker.settings import WorkerSettings as cls
    elif service == "engine":
        from services.engine.cli import serve
        from services.engine.settings import EngineSettings as cls
    else:
        raise ValueError(f"no settings for service {service!r}")
    # The options the serve factory built from the fields (core/kit/cli.py): what the service's
    # command line really accepts, so secrets and omitted settings have none.
    options = {
        name: param.default.param_decls[0]
        for name, param in inspect.signature(serve).parameters.items()
        if getattr(param.default, "param_decls", None)
    }
    return cls, options


def check_settings(service: str, given: Mapping[str, Any] | None) -> dict[str, str]:
    """`given` (setting name -> value) checked against the worker's or engine's settings class.

    Returns the text each value takes on the service's command line, by setting name (a boolean
    is true or false, as `bcstack serve` options take it). StackError, one line, for a name that
    is no setting (naming the closest one), a setting `up` sets itself, a secret, or a bad value
    (pydantic's message).
    """
    from pydantic import ValidationError

    if not given:
        return {}
    cls, options = _serve_options(service)
    flag = f"--{service}-setting"
    texts: dict[str, str] = {}
    for key, value in given.items():
        name = str(key).strip().replace("-", "_").lower()
        if name in MANAGED_SETTINGS[service]:
            raise StackError(f"{flag} {key}: `bcstack up` sets it itself")
        if name not in cls.model_fields:
            choices = sorted(
                n for n in options if n in cls.model_fields and n not in MANAGED_SETTINGS[service]
            )
            close = difflib.get_close_matches(name, choices, n=1)
            hint = f"; did you mean {close[0]}?" if close else f"; see `bcstack serve {service} --help`"
            raise StackError(f"{flag} {key}: no such {service} setting{hint}")
        if name not in options:
            from core.kit.settings import env_var_name

            raise StackError(
                f"{flag} {key}: not a command-line option of `bcstack serve {service}`; "
                f"set {env_var_name(cls, name)} in the environment of `bcstack up` instead"
            )
        if value is None:
            raise StackError(f"{flag} {key}: needs a value")
        if isinstance(value, bool):
            value = "true" if value else "false"
        elif "/" in options[name]:  # a boolean's pair of flags takes true or false here, as its variable
            value = _boolean_text(flag, key, value)
        elif isinstance(value, list | tuple | dict):
            value = json.dumps(value)
        texts[name] = str(value)
    try:
        cls(**texts)  # validated as the service will: these values, plus its environment variables
    except ValidationError as exc:
        problems = []
        for err in exc.errors(include_url=False):
            name = str((err.get("loc") or ("?",))[0])
            where = f"{flag} {name}={texts[name]}" if name in texts else f"{service} setting {name}"
            problems.append(f"{where}: {err['msg']}")
        raise StackError("; ".join(problems)) from None
    return texts


def _boolean_text(flag: str, key: Any, value: Any) -> str:
    from pydantic import TypeAdapter, ValidationError

    try:
        return "true" if TypeAdapter(bool).validate_python(value) else "false"
    except ValidationError:
        raise StackError(f"{flag} {key}={value}: not a boolean (true or false)") from None


def setting_flags(service: str, settings: Mapping[str, Any] | None) -> list[str]:
    """`settings` as the `bcstack serve <service>` command-line options: ["--snippet-words", "24", ...]."""
    _, options = _serve_options(service)
    flags: list[str] = []
    for name, text in check_settings(service, settings).items():
        on, sep, off = options[name].partition("/")
        # A boolean setting is a pair of flags (`--log-json/--no-log-json`, core/kit/cli.py).
        flags += [(on if text == "true" else off).strip()] if sep else [options[name], text]
    return flags


def parse_settings(flag: str, items: Iterable[str]) -> dict[str, str]:
    """KEY=VALUE command-line items as a mapping (a repeated key: the last one wins)."""
    settings = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise StackError(f"{flag} takes KEY=VALUE, not {item!r}")
        settings[key.strip()] = value
    return settings


def check_records(records_backend: str, gateways: int, records: Path | None) -> None:
    """StackError (one line) for a records backend `up` cannot run the gateways on."""
    if records_backend not in RECORDS_BACKENDS:
        raise StackError(f"--records-backend {records_backend}: choose {' or '.join(RECORDS_BACKENDS)}")
    if gateways < 1:
        raise StackError(f"--gateways must be at least 1, got {gateways}")
    if gateways > 1 and records_backend != "postgres":
        # Each gateway on a SQLite file of its own would answer only for the episodes it ran.
        raise StackError(f"--gateways {gateways} needs --records-backend postgres (one store they all share)")
    if records is not None and records_backend != "sqlite":
        raise StackError(f"--records {records}: a SQLite file; with --records-backend postgres leave it out")


def check_assets(
    *, world: Path | None = None, kit: Path | None = None, index: Path | None = None, dense: str | None = None
) -> None:
    """StackError (one line) when a given world, tiny kit or index folder is not one, or `dense` unknown."""
    if dense is not None and dense not in DENSE_CHOICES:
        raise StackError(f"--dense {dense}: choose {' or '.join(DENSE_CHOICES)}")
    if world is not None:
        missing = [f for f in ("corpus.jsonl", "questions.jsonl") if not (world / f).is_file()]
        if missing:
            raise StackError(f"--world {world}: not a toy world folder (no {' or '.join(missing)})")
    if kit is not None:
        if not (kit / "config.json").is_file():
            raise StackError(f"--kit {kit}: not a model folder (no config.json)")
        if not any((kit / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
            raise StackError(f"--kit {kit}: no tokenizer (no tokenizer.json or tokenizer_config.json)")
    if index is not None:
        problem = _index_problem(index)
        if problem:
            raise StackError(f"--index-dir {index}: {problem}")


def ensure_assets(
    state: Path,
    *,
    docs: int,
    seed: int,
    questions_per_tier: int,
    say: Callable[[str], None],
    train_questions: tuple[int, int] = (100, 50),
    world: Path | None = None,
    kit: Path | None = None,
    index: Path | None = None,
    dense: str | None = None,
) -> dict[str, Path]:
    """The toy world, the tiny model and the index: the given ones, else built under `state` when missing.

    `train_questions` is the toy train split (medium, hard) made with a new world. `dense` is the
    dense backend of an index built here (`bcstack index --dense`; unset: its default, edge); an
    index already there built with another one is refused rather than silently used.
    """
    from devkit.modelkit.build import build_tiny_kit
    from devkit.toyworld.generator import ToyWorldError, generate_world, write_world

    check_assets(world=world, kit=kit, index=index, dense=dense)
    world_given, index_given = world is not None, index is not None
    world = world or state / "world"
    tiny = kit or state / "tiny"
    index = index or state / "index"
    if not world_given and not (world / "corpus.jsonl").is_file():
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
    if kit is None and not (tiny / "config.json").is_file():
        say(f"building the tiny Qwen3 model in {tiny}")
        # The fixed toy text, not this world's corpus: one kit serves every toy world.
        build_tiny_kit(tiny, seed=seed)
    if not index_given and _index_problem(index):
        say(f"indexing the corpus into {index}")
        args = ["--corpus", str(world / "corpus.jsonl"), "--index-dir", str(index)]
        if dense is not None:
            args += ["--dense", dense]
        result = subprocess.run([sys.executable, "-m", "bcstack", "index", *args], check=False)
        if result.returncode != 0:
            raise StackError(f"indexing failed (exit {result.returncode}); see the output above")
    manifest = _read_manifest(index) or {}
    if dense is not None and manifest.get("dense") != dense:
        raise StackError(
            f"the index {index} was built with dense {manifest.get('dense')!r}, not {dense!r}; "
            + (
                "give another --index-dir"
                if index_given
                else "remove it to rebuild it, or use another --state"
            )
        )
    corpus_bytes = manifest.get("corpus", {}).get("bytes")
    if corpus_bytes is not None and corpus_bytes != (world / "corpus.jsonl").stat().st_size:
        say(f"note: the index {index} was built from another corpus than {world / 'corpus.jsonl'}")
    return {"world": world, "tiny": tiny, "index": index}


def _resolved(path: Path | None) -> Path | None:
    return Path(path).resolve() if path is not None else None


def _read_manifest(index: Path) -> dict[str, Any] | None:
    try:
        manifest = json.loads((index / "manifest.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return manifest if isinstance(manifest, dict) else None


def _index_problem(index: Path) -> str | None:
    """Why `index` is not a complete retrieval index, or None."""
    if not (index / "manifest.json").is_file():
        return "not an index folder (no manifest.json)"
    manifest = _read_manifest(index)
    if manifest is None:
        return "its manifest.json is unreadable"
    if not manifest.get("complete"):
        return "an incomplete index (its manifest.json says complete: false); finish it with `bcstack index`"
    return None


def plan(
    state: Path,
    assets: dict[str, Path],
    worker: str,
    token: str,
    *,
    worker_settings: Mapping[str, Any] | None = None,
    engine_settings: Mapping[str, Any] | None = None,
    records: Path | None = None,
    replicas: int = 1,
    records_url: str | None = None,
    gateways: int = 1,
    reserved: Iterable[int] = (),
) -> list[Service]:
    """The services `up` starts, with their command lines and ports.

    `worker_settings` / `engine_settings` (setting name -> value) go to those services as their
    options (see `check_settings`); `records` is the gateway's record file (default STATE/records.sqlite).
    `replicas` engine + worker pairs serve episodes; the gateway routes to the least busy one.
    `records_url` (a PostgreSQL URL, a secret) replaces the file: it reaches the `gateways` gateway
    processes in their environment, never on their command line. `reserved`: ports already taken.
    """
    if replicas < 1:
        raise StackError(f"--replicas must be at least 1, got {replicas}")
    worker_flags = setting_flags("worker", worker_settings)
    engine_flags = setting_flags("engine", engine_settings)
    taken: set[int] = set(reserved)
    # BCSTACK_UP_PORTS=any: ports the OS picks even where the chart's defaults are free, for several
    # stacks started at once on one machine (the suite under pytest-xdist): two `up`s that both find
    # 8001 free would race to bind it.
    defaults = os.environ.get("BCSTACK_UP_PORTS", "default") != "any"
    ports = {
        name: (
            _pick_port(h if defaults else None, taken),
            _pick_port(g if defaults else None, taken) if g else None,
        )
        for name, (h, g) in DEFAULT_PORTS.items()
    }
    tiny = assets["tiny"]
    if worker in ("expert", "expert-snippets"):
        engine_args = ["--policy", worker, "--tokenizer", str(tiny), "--world", str(assets["world"])]
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
        if name in ports:
            http, grpc_port = ports[name]
        else:  # a further replica: ports the OS picks
            preferred_grpc = DEFAULT_PORTS[base_name(name)][1]
            http = _pick_port(None, taken)
            grpc_port = _pick_port(None, taken) if preferred_grpc else None
        full = ["serve", base_name(name), *args, "--port", str(http)]
        if grpc_port is not None:
            full += ["--grpc-port", str(grpc_port)]
        return Service(name, full, http, grpc_port, env=dict(env))

    retrieval = svc("retrieval", ["--index-dir", str(assets["index"])])
    pairs = []
    for r in range(1, replicas + 1):
        engine = svc(replica_name("engine", r), [*engine_args, *engine_flags])
        worker_svc = svc(
            replica_name("worker", r),
            [
                "--tokenizer",
                str(tokenizer),
                "--engine-url",
                engine.http,
                "--retrieval-address",
                retrieval.grpc or "",
                # `bcstack train rl --state` writes its exports under STATE/train; the worker reloads them.
                "--checkpoint-root",
                str(state / TRAIN_DIR),
                *worker_flags,
            ],  # fmt: skip
        )
        pairs += [engine, worker_svc]
    llm = svc("coordinator-llm", ["--policy", "scripted"])
    gateway_args = [
        "--coordinator-url", f"{llm.http}/v1",
        "--workers", ",".join(w.grpc or "" for w in pairs[1::2]),
        *([] if records_url else ["--records", str(records or state / "records.sqlite")]),
        # the episode viewer (/ui) decodes worker token ids with the workers' own tokenizer
        *(["--tokenizer", str(tokenizer)] if (Path(tokenizer) / "tokenizer.json").is_file() else []),
    ]  # fmt: skip
    gateway_replicas = []
    for r in range(1, gateways + 1):
        gateway = svc(replica_name("coordinator", r), gateway_args)
        if records_url:
            gateway.env.update(gateway_env(records_url, gateway.name))
        gateway_replicas.append(gateway)
    judge = svc("judge", ["--cache-path", str(state / "judge-cache.sqlite")])
    return [retrieval, *pairs, llm, *gateway_replicas, judge]


def gateway_env(records_url: str, name: str) -> dict[str, str]:
    """A gateway's environment for a shared PostgreSQL store: the URL (a secret: not on its command
    line, so not in `ps` or stack.json) and its replica name, which its episode claims carry."""
    return {"BCSTACK_COORDINATOR_RECORDS_URL": records_url, "BCSTACK_COORDINATOR_REPLICA_NAME": name}


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


def start_service(args: list[str], env: dict[str, str], log_path: Path, *, append: bool = False) -> Any:
    """`python -m bcstack ARGS` as a service of the stack: `env` is its whole environment, its output
    goes to `log_path` (appended to with `append`), and it runs in a process group of its own, which
    `down` stops with it. Returns the `subprocess.Popen` (`up` and `restart` use its pid, `poll()`
    and `returncode`).

    The end-to-end tests swap this for one that forks each service from a process that has already
    imported it (tests/stack_util.py `forked_service`): the same command, seconds of imports fewer.
    """
    with log_path.open("a" if append else "w") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "bcstack", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # its own process group: `down` stops it and its children
        )


def up(
    state: Path,
    *,
    worker: str = "expert",
    docs: int = 2000,
    seed: int = 0,
    questions_per_tier: int = 50,
    train_questions: tuple[int, int] = (100, 50),
    world: Path | None = None,
    kit: Path | None = None,
    index: Path | None = None,
    dense: str | None = None,
    worker_settings: Mapping[str, Any] | None = None,
    engine_settings: Mapping[str, Any] | None = None,
    records: Path | None = None,
    replicas: int = 1,
    records_backend: str = "sqlite",
    gateways: int = 1,
    timeout: float = 300.0,
    say: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Build what is missing, start every service, wait until all are healthy; return stack.json's content.

    world / kit / index: an existing toy world, tiny kit (the tokenizer; with worker="tiny" also
    the model) and retrieval index, used as they are instead of the ones under `state`. dense: the
    dense backend (edge or none) of an index `up` builds. worker_settings / engine_settings: those
    services' settings by name (`{"snippet_words": "24"}`). records: the gateway's record file.
    replicas: engine + worker pairs (one core each on the CPU; the gateway spreads episodes over them).
    records_backend: sqlite (the file) or postgres (a PostgreSQL server of the stack's own in
    STATE/postgres, kept across down and up). gateways: gateway processes on that one PostgreSQL,
    behind one HAProxy front whose URL is stack.json's "gateway" (bcstack/stack_gateways.py).
    Everything given is checked before anything is built or started.
    """
    from bcstack import stack_gateways

    if replicas < 1:
        raise StackError(f"--replicas must be at least 1, got {replicas}")
    check_records(records_backend, gateways, records)
    stack_gateways.check_programs(records_backend, gateways)
    world, kit, index, records = (_resolved(p) for p in (world, kit, index, records))
    settings = {
        "worker": check_settings("worker", worker_settings),
        "engine": check_settings("engine", engine_settings),
    }
    check_assets(world=world, kit=kit, index=index, dense=dense)
    state = state.resolve()
    state.mkdir(parents=True, exist_ok=True)
    info = read_state(state)
    if info is not None:
        alive = running_pids(info)
        server = stack_gateways.postgres_of(info)
        if server is not None and server.running():
            alive["postgres"] = server.port
        if alive:
            listed = ", ".join(f"{n} ({'port' if n == 'postgres' else 'pid'} {p})" for n, p in alive.items())
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
        world=world,
        kit=kit,
        index=index,
        dense=dense,
    )
    records = records or state / "records.sqlite"
    defaults = os.environ.get("BCSTACK_UP_PORTS", "default") != "any"  # as in `plan`
    reserved: set[int] = set()
    front_port = (
        _pick_port(DEFAULT_PORTS["coordinator"][0] if defaults else None, reserved) if gateways > 1 else None
    )  # the front takes the gateway's usual port: the apps' URL stays what one gateway gives
    pg_port = _pick_port(None, reserved) if records_backend == "postgres" else None
    token_path = state / TOKEN_FILE
    if not token_path.is_file():
        token_path.write_text(secrets.token_urlsafe(24) + "\n")
        token_path.chmod(0o600)
    token = token_path.read_text().strip()
    (state / TRAIN_DIR).mkdir(exist_ok=True)
    logs = state / "logs"
    logs.mkdir(exist_ok=True)
    started: list[Service] = []
    procs: dict[str, subprocess.Popen] = {}
    server = front = None
    try:
        if pg_port is not None:
            server = stack_gateways.start_postgres(state, pg_port)
            say(f"  {'postgres':16s} {server.public_url}")
        services = plan(
            state,
            assets,
            worker,
            token,
            worker_settings=settings["worker"],
            engine_settings=settings["engine"],
            records=records,
            replicas=replicas,
            records_url=server.url if server else None,
            gateways=gateways,
            reserved=reserved,
        )
        described = {
            "worker": worker,
            "replicas": replicas,
            "gateways": gateways,
            "records_backend": records_backend,
            "assets": {
                **{k: str(v) for k, v in assets.items()},
                "records": server.public_url if server else str(records),
            },
            "settings": settings,
            **({"postgres": stack_gateways.postgres_entry(server)} if server else {}),
        }
        # Every service starts at once (their imports overlap on the cores), then each is waited for in
        # plan order; none needs another to be up to start (clients connect when first used).
        for service in services:
            procs[service.name] = start_service(
                service.args, {**os.environ, **service.env}, logs / f"{service.name}.log"
            )
            service.pid = procs[service.name].pid
            started.append(service)
        _write_state(state, started, described)
        deadline = time.monotonic() + timeout
        for service in services:
            proc = procs[service.name]
            while not _healthy(service.http):
                if proc.poll() is not None:
                    raise StackError(
                        f"{service.name} exited with {proc.returncode}; the end of its log "
                        f"({logs / (service.name + '.log')}):\n" + _tail(logs / f"{service.name}.log")
                    )
                if time.monotonic() > deadline:
                    raise StackError(f"{service.name} was not healthy within {timeout:.0f} s; see {logs}")
                time.sleep(0.1)
            say(f"  {service.name:16s} {service.http}" + (f"  gRPC {service.grpc}" if service.grpc else ""))
        gateway = next(s for s in services if s.name == "coordinator").http
        if front_port is not None:
            backends = [s for s in services if base_name(s.name) == "coordinator"]
            front = stack_gateways.start_front(
                state, front_port, [f"127.0.0.1:{s.http_port}" for s in backends]
            )
            assert front.proc is not None
            # In services, so that `down` stops it and a second `up` sees it run; no `bcstack` command line.
            started.append(Service(FRONT, [], front_port, None, pid=front.proc.pid))
            gateway = front.url
            say(f"  {FRONT:16s} {front.url}  (HAProxy over {', '.join(s.name for s in backends)})")
        described["gateway"] = gateway
    except BaseException:
        if front is not None:
            front.stop()
        _stop(started)
        if server is not None:
            stack_gateways.stop_postgres(server)
        (state / STATE_FILE).unlink(missing_ok=True)
        raise
    return _write_state(state, started, described)


def _write_state(state: Path, services: list[Service], described: dict[str, Any]) -> dict[str, Any]:
    """stack.json: `described` (the worker, the assets, the settings given) and every service started."""
    info = {
        **described,
        "state": str(state),
        "admin_token_file": str(state / TOKEN_FILE),
        # "args": the `bcstack` command line of each, so `restart` starts it again exactly as it was.
        "services": {
            s.name: {"http": s.http, "grpc": s.grpc, "pid": s.pid, "args": s.args} for s in services
        },
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


@contextlib.contextmanager
def sigterm_runs_finally():
    """While active, SIGTERM raises SystemExit(143) in the main thread, as Ctrl-C raises
    KeyboardInterrupt, so the `finally` that stops a command's stack runs. Python's default SIGTERM
    ends the process at once, without it: a speedrun or demo stopped by `kill`, `timeout` or a job
    scheduler left its services running. Outside the main thread (no handler can be set) it does
    nothing; the previous handler comes back on exit."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def _exit(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, _exit)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def down(state: Path, *, say: Callable[[str], None] = print) -> int:
    """Stop the stack started from `state`; the number of services stopped."""
    state = state.resolve()
    info = read_state(state)
    if info is None:
        raise StackError(f"no stack was started from {state} (no {STATE_FILE})")
    from bcstack import stack_gateways

    alive = running_pids(info)
    order = [alive[name] for name in sorted(alive, key=_start_rank)]
    killed = _stop(order)
    for name in alive:
        say(f"  stopped {name} (pid {alive[name]})" + (" with SIGKILL" if alive[name] in killed else ""))
    stopped = len(alive)
    server = stack_gateways.postgres_of(info)
    if server is not None and stack_gateways.stop_postgres(server):  # after the gateways it serves
        say(f"  stopped postgres ({server.public_url}; its data stays in {server.folder})")
        stopped += 1
    (state / STATE_FILE).unlink(missing_ok=True)
    return stopped


def restart(
    state: Path, name: str, *, timeout: float = 300.0, say: Callable[[str], None] = print
) -> dict[str, Any]:
    """Start service `name` of the stack in `state` again, with the command line and ports it had.

    A running one is stopped first (SIGTERM, then SIGKILL after the grace); a dead one (crashed,
    killed) is just started. Waits until it is healthy, records its new pid in stack.json and
    returns stack.json's content. Its log goes on in STATE/logs/NAME.log. StackError, one line,
    for no stack, an unknown name, or a service that exits or stays unhealthy.
    """
    state = state.resolve()
    info = read_state(state)
    if info is None:
        raise StackError(f"no stack was started from {state} (no {STATE_FILE}); start one with `bcstack up`")
    services = info.get("services", {})
    if name not in services:
        known = ", ".join(sorted(services, key=_start_rank))
        raise StackError(f"no service {name!r} in {state / STATE_FILE}; its services: {known}")
    entry = services[name]
    if name == FRONT:
        return _restart_front(state, info, say)
    args = entry.get("args")
    if not args:
        raise StackError(
            f"{state / STATE_FILE} has no command line for {name} (written by an older bcstack); "
            f"run `bcstack down --state {state}` and `bcstack up` again"
        )
    pid = entry.get("pid")
    if pid and _alive(pid):
        say(f"  stopping {name} (pid {pid})")
        _stop([pid])
    token_path = state / TOKEN_FILE
    env = {"BCSTACK_ADMIN_TOKEN": token_path.read_text().strip()} if token_path.is_file() else {}
    if base_name(name) == "coordinator":
        from bcstack.stack_gateways import postgres_of

        server = postgres_of(info)
        if server is not None:
            env.update(gateway_env(server.url, name))
    log_path = state / "logs" / f"{name}.log"
    log_path.parent.mkdir(exist_ok=True)
    with log_path.open("a") as log:
        log.write(f"\n--- bcstack restart {name} at {time.strftime('%Y-%m-%d %H:%M:%S')} ---\n")
    proc = start_service(args, {**os.environ, **env}, log_path, append=True)
    _update_pid(state, name, proc.pid)
    deadline = time.monotonic() + timeout
    while not _healthy(entry["http"]):
        if proc.poll() is not None:
            raise StackError(
                f"{name} exited with {proc.returncode} after the restart; the end of its log "
                f"({log_path}):\n" + _tail(log_path)
            )
        if time.monotonic() > deadline:
            raise StackError(f"{name} was not healthy within {timeout:.0f} s of the restart; see {log_path}")
        time.sleep(0.1)
    say(f"  {name:16s} {entry['http']} (pid {proc.pid})")
    return read_state(state) or {}


def _restart_front(state: Path, info: dict[str, Any], say: Callable[[str], None]) -> dict[str, Any]:
    """The HAProxy front again, on its port, over the gateways stack.json lists."""
    from bcstack.stack_gateways import start_front

    entry = info["services"][FRONT]
    if entry.get("pid") and _alive(entry["pid"]):
        say(f"  stopping {FRONT} (pid {entry['pid']})")
        _stop([entry["pid"]])
    names = sorted(
        (n for n in info["services"] if base_name(n) == "coordinator"), key=lambda n: (n != "coordinator", n)
    )
    backends = [info["services"][n]["http"].removeprefix("http://") for n in names]
    front = start_front(state, int(entry["http"].rsplit(":", 1)[1]), backends)
    assert front.proc is not None
    _update_pid(state, FRONT, front.proc.pid)
    say(f"  {FRONT:16s} {front.url} (pid {front.proc.pid})")
    return read_state(state) or {}


def _update_pid(state: Path, name: str, pid: int) -> None:
    """stack.json with service `name`'s pid replaced, written atomically."""
    info = read_state(state) or {}
    info["services"][name]["pid"] = pid
    tmp = state / (STATE_FILE + ".tmp")
    tmp.write_text(json.dumps(info, indent=2) + "\n")
    os.replace(tmp, state / STATE_FILE)
