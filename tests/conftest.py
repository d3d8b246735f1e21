"""Shared test helpers, kept generic: free loopback ports and bounded waiting.

Fixtures: `free_port` (an unused loopback TCP port), `tiny_kit` (a copy of the default tiny kit,
built once per session and seed), `toy_kit` (one toy world, tiny model and index for the whole
session, shared by pytest-xdist's workers). Plain helpers, importable as
`from conftest import find_free_port, wait_for_port, wait_until`.

`make test` runs the suite on two pytest-xdist workers (PYTEST_WORKERS), a module at a time each
(`--dist loadfile`), the slowest modules first (`SLOWEST_FIRST`) so that no long module starts last
and runs alone (docs/development.md: the measured times). `PYTEST_WORKERS=0` runs one process.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest

pytest_plugins = ["fixtures_fuzz"]

LOOPBACK = "127.0.0.1"
T = TypeVar("T")

# Modules by their time alone in the last measured full run, longest first (the rest keep pytest's
# order after them). Under `--dist loadfile --no-loadscope-reorder` each worker takes the next module
# in this order when it is free: longest-first keeps the two workers' finishing times close.
SLOWEST_FIRST = (
    "test_trainer_distributed.py",
    "test_alerts_live.py",
    "test_rl_loop.py",
    "test_eval_stack.py",
    "test_speedrun.py",
    "test_coordinator_service.py",
    "test_gateway_replicas.py",
    "test_canary_live.py",
    "test_extras.py",
    "test_loadtest.py",
    "test_worker_service.py",
    "test_retrieval_service.py",
    "test_specialists.py",
    "test_stack_gateways.py",
    "test_record_store.py",
    "test_record_readers_pg.py",
    "test_engine_prefix_cache.py",
    "test_grpc_fuzz.py",
    "test_trainer_grpo.py",
    "test_http_fuzz.py",
)


def pytest_collection_modifyitems(session, config, items) -> None:
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return  # one process: pytest's own order
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    # sort is stable: within a module, and among the unranked modules, pytest's order stays
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


# An item (setup + call + teardown, so the fixtures it starts count) should take at most this long;
# the terminal summary names every one over it that pyproject's `long_items` does not list with a reason.
ITEM_SECONDS = 90.0


def pytest_addoption(parser) -> None:
    parser.addini(
        "long_items",
        "test ids allowed past ITEM_SECONDS, one a line: `nodeid  # reason`",
        type="linelist",
        default=[],
    )


def _item_seconds(terminalreporter) -> dict[str, float]:
    """Seconds per test id, setup + call + teardown, from every report the run produced."""
    seconds: dict[str, float] = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            if getattr(report, "when", None) in ("setup", "call", "teardown"):
                seconds[report.nodeid] = seconds.get(report.nodeid, 0.0) + report.duration
    return seconds


@pytest.hookimpl(trylast=True)  # after pytest's own `--durations` table: the log ends with both
def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    """After pytest's own `--durations`: each module's total, longest first, and any item past
    ITEM_SECONDS that pyproject does not allow, so the suite's time is visible in CI's log."""
    seconds = _item_seconds(terminalreporter)
    if not seconds:
        return
    modules: dict[str, tuple[float, int]] = {}
    for nodeid, s in seconds.items():
        total, count = modules.get(nodeid.split("::")[0], (0.0, 0))
        modules[nodeid.split("::")[0]] = (total + s, count + 1)
    write = terminalreporter.write_line
    terminalreporter.section("seconds per module (setup + call + teardown)")
    for module, (total, count) in sorted(modules.items(), key=lambda kv: -kv[1][0]):
        write(f"{total:8.1f} s  {count:4d} items  {module}")
    write(f"{sum(seconds.values()):8.1f} s  {len(seconds):4d} items  in all")
    allowed = {line.split("#")[0].strip() for line in config.getini("long_items")}
    over = sorted(((s, n) for n, s in seconds.items() if s > ITEM_SECONDS and n not in allowed), reverse=True)
    if over:
        terminalreporter.section(f"items over {ITEM_SECONDS:.0f} s not listed in pyproject's long_items")
        for s, nodeid in over:
            write(f"{s:8.1f} s  {nodeid}")


def pytest_configure(config) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # Several workers' stacks start at once: the chart's default ports would race (bcstack.stack).
        os.environ["BCSTACK_UP_PORTS"] = "any"
        # One OpenMP thread per torch process (the worker and every process it starts). With two
        # workers each running torch processes of two threads on two cores, OpenMP's spinning at its
        # barriers while the partner thread waits for a core made training steps ~15x slower (a
        # 0.15 s SFT step took 2-13 s), where one thread per process loses at most 2x.
        os.environ.setdefault("OMP_NUM_THREADS", "1")


_PORT_SPAN = 1500  # ports per pytest-xdist worker: a session asks for a few hundred
_port_turn = itertools.count()


def _port_slice() -> range | None:
    """This process's own ports, below the OS's ephemeral range (where `bind(0)`, outgoing connections
    and every service that picks its own port live), one slice per pytest-xdist worker; None where the
    ephemeral range leaves no room below it."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    index = int(worker) % 8 if worker.isdigit() else 0
    base = low - 8 * _PORT_SPAN
    if base < 10_000:
        return None
    return range(base + index * _PORT_SPAN, base + (index + 1) * _PORT_SPAN)


def find_free_port(host: str = LOOPBACK) -> int:
    """A TCP port nothing listens on right now and this session has not handed out before.

    Two ports asked for back to back (a service's HTTP and gRPC ports) used to be whatever `bind(0)`
    gave, and the OS may give the same one twice: a judge then bound its gRPC port and found its
    HTTP port taken by itself (stop 48's CI). Ports now come in turn from this worker's own slice
    below the ephemeral range, skipping any in use, so no two asks, no two workers, and no port the
    OS hands out elsewhere meet; a race with a process outside the suite is still possible but rare.
    """
    ports = _port_slice()
    if ports is None:  # no room below the ephemeral range: let the OS pick
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            return sock.getsockname()[1]
    for _ in range(len(ports)):
        port = ports[next(_port_turn) % len(ports)]
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {ports.start}-{ports.stop - 1}")


def wait_for_port(port: int, host: str = LOOPBACK, timeout: float = 10.0) -> None:
    """Block until something accepts TCP connections on host:port; TimeoutError after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing listens on {host}:{port} after {timeout:.0f} s") from None
            time.sleep(0.05)


def wait_until(
    predicate: Callable[[], T], timeout: float = 10.0, interval: float = 0.1, message: str = "condition"
) -> T:
    """Poll `predicate` until it returns something truthy and return that; TimeoutError otherwise.

    Exceptions raised by the predicate count as "not yet" (a server still starting up).
    """
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while True:
        try:
            result = predicate()
            if result:
                return result
        except Exception as exc:
            last_error = exc
        if time.monotonic() > deadline:
            detail = f" (last error: {last_error!r})" if last_error else ""
            raise TimeoutError(f"{message} not met within {timeout:.0f} s{detail}")
        time.sleep(interval)


def bench_module(name: str):
    """`bench/NAME.py` loaded as a module: the benches are scripts beside the package, not in it."""
    path = Path(__file__).resolve().parents[1] / "bench" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # as an import does: a dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def free_port() -> int:
    """An unused loopback TCP port."""
    return find_free_port()


def _session_root(tmp_path_factory) -> Path:
    """The folder every worker of one session shares (under pytest-xdist: above each worker's own)."""
    shared = tmp_path_factory.getbasetemp()
    return shared.parent if os.environ.get("PYTEST_XDIST_WORKER") else shared


@pytest.fixture(scope="module")
def forked_services():
    """`bcstack.stack.up` and `restart` fork the services of this module's stacks from a process that
    has imported them (stack_util.forked_service): the same commands, ~1-6 s of imports fewer each.
    For modules whose subject is not how a stack's processes start (tests/test_eval_stack.py's is,
    and keeps `python -m bcstack`). Use: `pytestmark = pytest.mark.usefixtures("forked_services")`."""
    from stack_util import forked_service, warm_forkserver

    from bcstack import stack

    warm_forkserver()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(stack, "start_service", forked_service)
        yield


@pytest.fixture(scope="session")
def tiny_kit(tmp_path_factory) -> Callable[..., Path]:
    """`tiny_kit(dest, seed=0)`: a private copy at `dest` of the default tiny kit of that seed
    (`build_tiny_kit(dest, seed=seed)`), each seed built once per session; a copy costs milliseconds,
    a build ~5-9 s, and a dozen modules need one."""
    import shutil

    from filelock import FileLock

    from devkit.modelkit.build import build_tiny_kit

    root = _session_root(tmp_path_factory)

    def copy(dest, seed: int = 0) -> Path:
        built = root / f"tiny-kit-seed{seed}"
        with FileLock(str(root / f"tiny-kit-seed{seed}.lock")):
            if not (built / "COMPLETE").exists():
                shutil.rmtree(built, ignore_errors=True)
                build_tiny_kit(built / "kit", seed=seed)
                (built / "COMPLETE").touch()
        dest = Path(dest)
        shutil.copytree(built / "kit", dest, dirs_exist_ok=True)
        return dest

    return copy


@pytest.fixture(scope="session")
def toy_kit(tmp_path_factory, tiny_kit):
    """One toy world (500 documents, seed 5, 8 test questions per tier, no train split), the tiny
    model and its retrieval index (documents embedded to 128 tokens), built once per test session for
    the end-to-end suites.

    Returns {"dir", "world"}: `dir` holds `world/`, `tiny/` and `idx/`; treat them as read-only.
    """
    import subprocess
    import sys

    from filelock import FileLock

    from devkit.toyworld.generator import generate_world, write_world

    world = generate_world(500, 5, questions_per_tier=8, train_medium=0, train_hard=0)
    # Under pytest-xdist every worker has its own basetemp below one shared folder: the first worker
    # to get here builds the kit there, the others wait on the lock and use it.
    shared = _session_root(tmp_path_factory)
    root = shared / "toy-kit"
    with FileLock(str(shared / "toy-kit.lock")):
        if not (root / "COMPLETE").exists():
            root.mkdir(exist_ok=True)
            write_world(world, root / "world")
            tiny_kit(root / "tiny")
            # Documents embedded to 128 tokens, not MiniLM's 256: the toy pages run 200-256 tokens,
            # and the build that every end-to-end module waits for takes half the CPU (44 s against
            # 82 s on the 2-core EPYC). Queries are shorter than either.
            index = subprocess.run(
                [sys.executable, "-m", "bcstack", "index", "--corpus", str(root / "world" / "corpus.jsonl"),
                 "--index-dir", str(root / "idx")],
                capture_output=True, text=True,
                env={**os.environ, "BCSTACK_RETRIEVAL_EMBED_MAX_LENGTH": "128"},
            )  # fmt: skip
            assert index.returncode == 0, index.stderr
            (root / "COMPLETE").touch()
    if shared != tmp_path_factory.getbasetemp():
        # A retrieval process locks its index's dense WAL: two workers' stacks serving one index
        # would refuse each other ("Can't init WAL: WouldBlock"). Each worker serves its own copy
        # (6 MB, milliseconds); within a worker the modules run one after another.
        import shutil

        own = tmp_path_factory.getbasetemp() / "toy-kit"
        if not (own / "COMPLETE").exists():
            shutil.copytree(root, own, dirs_exist_ok=True)
        root = own
    return {"dir": root, "world": world}


def link_toy_kit(kit: dict, into) -> None:
    """Make `into/world`, `into/tiny` and `into/idx` point at the shared toy kit."""
    for name in ("world", "tiny", "idx"):
        (into / name).symlink_to(kit["dir"] / name, target_is_directory=True)
