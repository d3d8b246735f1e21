"""SIGTERM stops a command's stack: `sigterm_runs_finally` turns it into SystemExit so the `finally`
that runs `down` runs, and the speedrun and the demo run inside it.

A process that Python's default SIGTERM ends skips its `finally` blocks: a speedrun stopped by `kill`
or a scheduler left its gateway, workers and engines running. The real thing is checked in a child
interpreter (a signal is delivered to a process, not a test), with and without the guard, so the
test fails if the guard does nothing.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from bcstack import demo, speedrun
from bcstack.stack import sigterm_runs_finally

CHILD = textwrap.dedent(
    """
    import subprocess, sys, time
    from bcstack.stack import sigterm_runs_finally

    sleeper = [sys.executable, "-c", "import time; time.sleep(120)"]
    service = subprocess.Popen(sleeper, stdout=subprocess.DEVNULL)  # not our pipe: communicate() ends
    guard = sigterm_runs_finally() if sys.argv[1] == "guard" else __import__("contextlib").nullcontext()
    with guard:
        try:
            print(service.pid, flush=True)
            time.sleep(120)
        finally:
            service.kill()
            service.wait()
            print("stack stopped", flush=True)
    """
)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("mode", ["guard", "default"])
def test_sigterm_runs_the_finally_that_stops_the_stack_only_under_the_guard(mode):
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, mode], stdout=subprocess.PIPE, text=True, cwd=os.getcwd()
    )
    service = int(proc.stdout.readline())
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    try:
        if mode == "guard":
            assert proc.returncode == 128 + signal.SIGTERM
            assert "stack stopped" in out
            deadline = time.monotonic() + 10
            while alive(service) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not alive(service)
        else:  # Python's own SIGTERM: killed by the signal, the finally never ran, the service lives on
            assert proc.returncode == -signal.SIGTERM
            assert "stack stopped" not in out
            assert alive(service)
    finally:
        if alive(service):
            os.kill(service, signal.SIGKILL)


def test_the_previous_handler_comes_back():
    before = signal.getsignal(signal.SIGTERM)
    with sigterm_runs_finally():
        assert signal.getsignal(signal.SIGTERM) is not before
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.parametrize("module", [speedrun, demo], ids=["speedrun", "demo"])
def test_the_speedrun_and_the_demo_run_under_the_guard(module, monkeypatch):
    """The handler in place while the command's body runs is the guard's (raising a real SIGTERM here
    would end the test process itself if it were not), and it raises SystemExit(143)."""
    seen = []

    def body(argv):
        handler = signal.getsignal(signal.SIGTERM)
        assert callable(handler)
        with pytest.raises(SystemExit) as e:
            handler(signal.SIGTERM, None)
        seen.append(e.value.code)
        return 0

    monkeypatch.setattr(module, "_main", body)
    assert module.main([]) == 0
    assert seen == [128 + signal.SIGTERM]
