"""Real `bcstack` processes for end-to-end tests: start one, wait until healthy, stop it.

    with bcstack_process(["serve", "worker", ...], "http://127.0.0.1:PORT/health") as proc: ...
    done = bcstack_forked(["train", "rl", ...])  # a subprocess.CompletedProcess
    with bcstack_process([...], url, forked=True) as proc: ...  # a server, forked: starts in ~1 s

Output goes to a temporary log file (a pipe nobody reads would fill and block a chatty server);
when the process dies before it is healthy the assertion quotes the log. `bcstack_forked` runs a
command as a new process forked from one that has already imported it (see there).
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing
import multiprocessing.forkserver
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx
from conftest import find_free_port


class ProcessExited(AssertionError):
    """A started bcstack process ended before it became healthy (its log in the message)."""


class BcstackProcess:
    """`bcstack ARGS` as a process of its own; `forked`: forked from the forkserver (`ForkedPopen`)
    instead of a new `python -m bcstack`, which spends seconds of CPU on its imports."""

    def __init__(
        self, args: list[str], log_path: Path, env: dict[str, str] | None = None, forked: bool = False
    ) -> None:
        self.args = args
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        if forked:
            self.proc = ForkedPopen(args, {**os.environ, **(env or {})}, log_path)
            return
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bcstack", *args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            text=True,
            env=None if env is None else {**os.environ, **env},
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_healthy(self, health_url: str, timeout: float) -> None:
        """Until `health_url` answers 200; ProcessExited at once if the process ends first (a
        process that exited does not come up: waiting out the timeout cost 180 s of the suite)."""
        what = " ".join(self.args[:2])
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise ProcessExited(f"{what} exited {self.proc.returncode}: {self.log()}")
            try:
                if httpx.get(health_url, timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} not healthy within {timeout:.0f} s: {self.log()[-2000:]}")
            time.sleep(0.2)

    def kill(self) -> None:
        """SIGKILL: no shutdown code runs (what a crash or an OOM kill looks like)."""
        self.proc.kill()
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._log.close()


@contextlib.contextmanager
def bcstack_process(
    args: list[str],
    health_url: str,
    timeout: float = 120,
    env: dict[str, str] | None = None,
    forked: bool = False,
) -> Iterator[BcstackProcess]:
    """``env`` is added to this process's environment; `forked`: see `BcstackProcess`."""
    log_path = Path(tempfile.mkstemp(prefix="bcstack-", suffix=".log")[1])
    process = BcstackProcess(args, log_path, env, forked)
    try:
        process.wait_healthy(health_url, timeout)
        yield process
    except BaseException:
        # pytest shows a failed test's captured output: the server's side of the story
        print(f"--- log of bcstack {' '.join(args[:2])} (last 6000 characters) ---\n{process.log()[-6000:]}")
        raise
    finally:
        process.stop()
        log_path.unlink(missing_ok=True)


@contextlib.contextmanager
def bcstack_processes(
    specs: list[tuple], timeout: float = 120, env: dict[str, str] | None = None, forked: bool = False
) -> Iterator[list[BcstackProcess]]:
    """Several `bcstack_process`es started at once (their imports overlap on the cores), each then
    waited for; stopped in reverse order. `specs`: (args, health URL) or (args, health URL, env)
    per process; a spec's env replaces `env`. `forked`: see `BcstackProcess`."""
    with contextlib.ExitStack() as stack:
        started: list[tuple[BcstackProcess, str]] = []
        for args, health_url, *own in specs:
            log_path = Path(tempfile.mkstemp(prefix="bcstack-", suffix=".log")[1])
            process = BcstackProcess(args, log_path, own[0] if own else env, forked)
            stack.callback(log_path.unlink, missing_ok=True)
            stack.callback(process.stop)
            started.append((process, health_url))
        for process, health_url in started:
            try:
                process.wait_healthy(health_url, timeout)
            except BaseException:
                print(f"--- log of bcstack {' '.join(process.args[:2])} ---\n{process.log()[-6000:]}")
                raise
        yield [process for process, _ in started]


def retrieval_spec(index_dir: Path, http: int, grpc_port: int) -> tuple[list[str], str]:
    """A `bcstack_processes` spec of the retrieval service on `index_dir`."""
    args = [
        "serve",
        "retrieval",
        "--index-dir",
        str(index_dir),
        "--port",
        str(http),
        "--grpc-port",
        str(grpc_port),
    ]
    return args, f"http://127.0.0.1:{http}/health"


# --- commands forked from an interpreter that has imported them ----------------------------------

# `bcstack train rl` spends ~8 s of CPU importing torch, transformers and torch.distributed before
# it reads its first option. Forked from multiprocessing's forkserver, which imports these once,
# each command is still a process of its own (its pid, exit status, SIGKILL, files left behind)
# that starts in milliseconds. The forkserver imports but never computes, so a child starts with
# no torch thread pool or tokenizer threads to inherit.
FORK_PRELOAD = ("stack_util", "bcstack.cli", "bcstack.rl.loop", "transformers.models.qwen3.modeling_qwen3")


def _forkserver() -> multiprocessing.context.BaseContext:
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(FORK_PRELOAD))
    return context


def warm_forkserver() -> None:
    """Start the forkserver's imports now (they run beside whatever the caller does next)."""
    _forkserver()
    multiprocessing.forkserver.ensure_running()


def _as_new_process(
    env: dict[str, str],
    stdout: str,
    stderr: str,
    whole_env: bool = False,
    new_session: bool = False,
    append: bool = False,
) -> None:
    """`whole_env`: `env` is the whole environment (the caller's now, not the forkserver's at its start);
    `new_session`: a session and process group of its own, as `Popen(start_new_session=True)`;
    `append`: the output goes on at the end of the files instead of replacing them."""
    if new_session:
        os.setsid()
    if whole_env:
        os.environ.clear()
    os.environ.update(env)
    if "OMP_NUM_THREADS" in env:
        # OpenMP read the variable when the forkserver loaded torch; a new process would read it now.
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    for fd, path in ((1, stdout), (2, stderr)):
        if fd == 2 and path == stdout:
            os.dup2(1, 2)  # one log, one file offset: the two streams interleave as with STDOUT
            continue
        target = os.open(path, os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC), 0o600)
        os.dup2(target, fd)
        os.close(target)


def _bcstack_main(args: list[str], env: dict[str, str], stdout: str, stderr: str, *options: bool) -> None:
    """`bcstack ARGS` in the forked child; `options` (whole_env, new_session, append) as `_as_new_process`."""
    _as_new_process(env, stdout, stderr, *options)
    sys.argv = ["bcstack", *args]
    from bcstack.cli import main

    main()


def _module_main(
    module: str, args: list[str], env: dict[str, str], stdout: str, stderr: str, forked_children: bool
) -> None:
    _as_new_process(env, stdout, stderr)
    if forked_children:
        _fork_children()
    sys.argv = [module, *args]
    try:
        sys.exit(importlib.import_module(module).main(args))
    finally:
        if forked_children:  # its forkserver goes with it (a multiprocessing child runs no atexit)
            multiprocessing.forkserver._forkserver._stop()


def _forked_bcstack_run(args: list[str]) -> None:
    """`bcstack.speedrun._run` forked: the command's output, then StackError if it failed."""
    from bcstack.stack import StackError

    done = bcstack_forked(args)
    sys.stdout.write(done.stdout)
    sys.stderr.write(done.stderr)
    sys.stdout.flush()
    if done.returncode != 0:
        raise StackError(f"`bcstack {' '.join(args[:3])} …` failed (exit {done.returncode}); see above")


def _fork_children() -> None:
    """In a forked command: the processes it starts are forked too, from a forkserver of its own
    (started on first use): its stacks' services (`bcstack.stack.start_service`, swapped as the
    `forked_services` fixture swaps it) and the speedrun's `bcstack` commands (`bcstack.speedrun._run`)."""
    # A forked command is a daemonic multiprocessing child, which may not start processes of its
    # own; this one is a command like any other, that starts them.
    multiprocessing.current_process()._config["daemon"] = False
    from bcstack import speedrun, stack

    stack.start_service = forked_service
    speedrun._run = _forked_bcstack_run


class ForkedBcstack:
    """`bcstack ARGS` forked from the forkserver; `env` is added to the environment. With `module`,
    `python -m MODULE ARGS` instead, for a module whose `main(argv)` returns the exit status;
    `forked_children` (with `module`): the processes it starts fork too (`_fork_children`)."""

    def __init__(
        self,
        args: Sequence[str],
        env: dict[str, str] | None = None,
        module: str | None = None,
        forked_children: bool = False,
    ) -> None:
        self.args = [module or "bcstack", *args]
        folder = Path(tempfile.mkdtemp(prefix="bcstack-fork-"))
        self._out, self._err = folder / "stdout", folder / "stderr"
        given = (list(args), dict(env or {}), str(self._out), str(self._err))
        target, given = (
            (_bcstack_main, given) if module is None else (_module_main, (module, *given, forked_children))
        )
        self.proc = _forkserver().Process(target=target, args=given, daemon=True)
        self.proc.start()

    def wait(self, timeout: float) -> subprocess.CompletedProcess:
        """Its exit status (negative: killed by that signal) and output, as `subprocess.run` gives them."""
        self.proc.join(timeout)
        out, err = self._out.read_text(errors="replace"), self._err.read_text(errors="replace")
        if self.proc.exitcode is None:
            self.kill()
            raise subprocess.TimeoutExpired(self.args, timeout, out, err)
        shutil.rmtree(self._out.parent, ignore_errors=True)
        return subprocess.CompletedProcess(self.args, self.proc.exitcode, out, err)

    def kill(self) -> None:
        """Kill it and remove its output folder."""
        self.proc.kill()
        self.proc.join(10)
        shutil.rmtree(self._out.parent, ignore_errors=True)


class ForkedPopen:
    """A long-running `bcstack ARGS` (a server) forked from the forkserver, with the part of
    `subprocess.Popen` that `BcstackProcess` uses; stdout and stderr go to `log_path`. `env` is the
    whole environment: the child gets the caller's environment of now, as `Popen` would;
    `new_session` as `Popen(start_new_session=True)`; `append`: the log goes on instead of restarting."""

    def __init__(
        self,
        args: Sequence[str],
        env: dict[str, str],
        log_path: Path,
        new_session: bool = False,
        append: bool = False,
    ) -> None:
        self.args = ["bcstack", *args]
        given = (list(args), dict(env), str(log_path), str(log_path), True, new_session, append)
        self._proc = _forkserver().Process(target=_bcstack_main, args=given, daemon=True)
        self._proc.start()
        self.pid = self._proc.pid

    @property
    def returncode(self) -> int | None:
        return self._proc.exitcode

    def poll(self) -> int | None:
        return self._proc.exitcode

    def send_signal(self, sig: int) -> None:
        if self._proc.exitcode is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self._proc.exitcode


def forked_service(
    args: list[str], env: dict[str, str], log_path: Path, *, append: bool = False
) -> ForkedPopen:
    """`bcstack.stack.start_service` forked (`ForkedPopen`): a stack service of its own process group
    with the environment and log `up` and `restart` give it, without the ~1-6 s of imports each."""
    return ForkedPopen(args, env, log_path, new_session=True, append=append)


def bcstack_forked(
    args: Sequence[str],
    *,
    env: dict[str, str] | None = None,
    timeout: float = 600,
    module: str | None = None,
    forked_children: bool = False,
) -> subprocess.CompletedProcess:
    """Run `bcstack ARGS` (or `python -m MODULE ARGS`) to its end as a forked process (`ForkedBcstack`)."""
    return ForkedBcstack(args, env, module, forked_children).wait(timeout)


def bcstack_ranks(
    args: Sequence[str], ranks: int, *, env: dict[str, str] | None = None, timeout: float = 600
) -> subprocess.CompletedProcess:
    """`bcstack ARGS` as `ranks` forked processes (`ForkedBcstack`, `env` added) joined as
    `torchrun --standalone --nproc_per_node RANKS` joins its ranks: each gets the environment torchrun
    gives a rank (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, all that
    the trainer and `init_process_group`'s env:// read). The ranks' output in rank order; the exit
    status is the first failing rank's. A rank that fails stops the others (torchrun's behaviour):
    one left waiting in a collective for its dead peer would wait out gloo's 30 minutes."""
    port = str(find_free_port())
    procs = [
        ForkedBcstack(args, env={
            **(env or {}), "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(ranks),
            "LOCAL_WORLD_SIZE": str(ranks), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
        })
        for r in range(ranks)
    ]  # fmt: skip
    deadline = time.monotonic() + timeout
    while any(p.proc.exitcode is None for p in procs) and time.monotonic() < deadline:
        if any(p.proc.exitcode not in (None, 0) for p in procs):
            time.sleep(2)  # the others' own error lines, if they have one to give
            for p in procs:
                if p.proc.exitcode is None:
                    p.proc.kill()
            break
        time.sleep(0.05)
    done = [p.wait(max(1.0, deadline - time.monotonic())) for p in procs]
    code = next((d.returncode for d in done if d.returncode != 0), 0)
    out = "".join(d.stdout for d in done)
    err = "".join(d.stderr for d in done)
    return subprocess.CompletedProcess(["bcstack", *args], code, out, err)
