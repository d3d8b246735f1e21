"""The fuzz stack (`devkit.fuzzstack`) as one session fixture for both fuzz modules.

    def test_x(fuzz_stack):
        fuzz_stack.urls["judge"]                    # HTTP base URL of a fuzzed service
        fuzz_stack.serving("bcstack.v1.JudgeService")  # (process spec, running process) for a gRPC service

`tests/test_http_fuzz.py` and `tests/test_grpc_fuzz.py` share the processes: the stack starts at
the first test that asks for it and stops after the last one in the run's order (not at the end of
the session, so its seven processes do not idle through the rest of the suite). Under
pytest-xdist each worker that runs one of the modules starts its own. `bench/fuzz_http.py` starts
the same stack with `started_stack`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import find_free_port
from stack_util import BcstackProcess, ProcessExited, bcstack_processes

from devkit.fuzzstack import HTTP_SERVICES, STACK_ENV, FuzzProcess, stack_layout


@dataclasses.dataclass
class FuzzStack:
    layout: list[FuzzProcess]
    processes: list[BcstackProcess]
    work: Path

    @property
    def urls(self) -> dict[str, str]:
        """HTTP base URL of each fuzzed service."""
        by_name = {p.name: p.http_url for p in self.layout}
        return {name: by_name[name] for name in HTTP_SERVICES}

    def serving(self, grpc_service: str) -> tuple[FuzzProcess, BcstackProcess] | None:
        """The process that serves `grpc_service` (a full name), or None."""
        for spec, proc in zip(self.layout, self.processes, strict=True):
            if grpc_service in spec.grpc_services:
                return spec, proc
        return None


# A free port is free when asked for, not when bound: under pytest-xdist another worker's process
# took one of the stack's eleven between the two (CI-like run: "address already in use").
PORT_ATTEMPTS = 3


@contextlib.contextmanager
def started_stack(kit: Path, work: Path, timeout: float = 180) -> Iterator[FuzzStack]:
    """The stack's processes on `kit` (world/, tiny/, idx/), healthy, until the block ends; on new
    ports when a process could not bind its own."""
    for attempt in range(1, PORT_ATTEMPTS + 1):
        layout = stack_layout(kit, work, find_free_port)
        specs = [(p.args, p.health_url) for p in layout]
        with contextlib.ExitStack() as running:
            try:
                procs = running.enter_context(
                    bcstack_processes(specs, timeout=timeout, env=STACK_ENV, forked=True)
                )
            except ProcessExited as exc:
                if "address already in use" in str(exc) and attempt < PORT_ATTEMPTS:
                    continue
                raise
            yield FuzzStack(layout, procs, work)
            return


_running: dict[str, contextlib.ExitStack] = {}
_last_user: dict[str, str] = {}


@pytest.fixture(scope="session")
def fuzz_stack(tmp_path_factory, toy_kit) -> Iterator[FuzzStack]:
    exits = contextlib.ExitStack()
    _running["stack"] = exits
    with exits:
        yield exits.enter_context(started_stack(toy_kit["dir"], tmp_path_factory.mktemp("fuzz-stack")))


@pytest.hookimpl(trylast=True)  # after conftest's reordering: the order the items will run in
def pytest_collection_modifyitems(session, config, items) -> None:
    users = [item.nodeid for item in items if "fuzz_stack" in getattr(item, "fixturenames", ())]
    if users:
        _last_user["nodeid"] = users[-1]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield
    if item.nodeid == _last_user.get("nodeid") and "stack" in _running:
        _running.pop("stack").close()  # the fixture's own teardown then finds nothing to stop
