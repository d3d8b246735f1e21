"""Schemathesis against every service's HTTP API, with real `bcstack serve` processes.

Shared by `tests/test_http_fuzz.py` (the short version in `make test`) and `bench/fuzz_http.py`
(the long one, with a report):

    with fuzz_stack(kit_dir, work_dir) as stack:          # the 7 processes, admin token set
        report = fuzz_service("judge", stack.urls["judge"], examples=...)

`fuzz_service` loads the service's `/openapi.json`, and for every operation draws cases from
schemathesis' Hypothesis strategies (positive: what the schema allows; negative: what it does
not), sends each to the running process and checks the answer:

- no 5xx, except a 503 the operation documents (an upstream that cannot answer: see README,
  "Fuzzing");
- the status code is one the operation documents, the content type and the body conform to the
  documented response schema (schemathesis' `status_code_conformance`,
  `content_type_conformance`, `response_schema_conformance`);
- an admin operation never answers 2xx without the admin token. Admin operations are fuzzed
  twice: without the token (every one; the answer must be 401) and with it (those in
  `WITH_TOKEN_SAFE` only, see there).

Only generation runs (no explicit examples, no shrinking, no database, no deadline): a failure is
reported with the case that caused it and fuzzing goes on, so one run lists every problem.
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import requests
from conftest import find_free_port
from stack_util import bcstack_processes

ADMIN_TOKEN = "fuzz-admin-token"
SERVICES = ("retrieval", "engine", "worker", "coordinator", "coordinator-llm", "judge")
LLM_MODEL = "scripted-coordinator"

# Admin operations fuzzed *with* the token too. The others change what the service does for every
# later case, so with the token they are left to their own tests; without it they are fuzzed like
# the rest (and must refuse):
# - engine POST /pause_generation: generation stops until /continue_generation comes;
# - engine POST /update_weights_from_disk: a path that loads would replace the weights;
# - coordinator PUT /admin/coordinator: could register and activate an endpoint that does not
#   answer, turning every later episode into a failure;
# - coordinator-llm PUT /admin/faults: could switch on injected 500s for every later request.
# The worker's POST /admin/reload is safe: its checkpoint root is an empty folder, so no
# generated path names a checkpoint, and what is exercised is the refusal of each bad one.
WITH_TOKEN_SAFE = {
    "engine": {"POST /flush_cache", "GET /flush_cache", "POST /continue_generation"},
    "worker": {"GET /admin/reload", "POST /admin/reload"},
    "coordinator": {"GET /admin/coordinator"},
    "coordinator-llm": {"GET /admin/faults"},
}

# The gateway's episode viewer (`/ui`, HTML for a person) is left out: it is driven in a real
# browser by its own tests, and is not part of the JSON API whose schema is fuzzed here.
VIEWER = "/ui"


@dataclasses.dataclass
class FuzzStack:
    urls: dict[str, str]
    work: Path


def _url(port: int) -> str:
    return f"http://127.0.0.1:{port}"


@contextlib.contextmanager
def fuzz_stack(kit: Path, work: Path, timeout: float = 180) -> Iterator[FuzzStack]:
    """The six services as `bcstack serve` processes on the toy kit (`kit` holds world/, tiny/,
    idx/), every one with BCSTACK_ADMIN_TOKEN set. The engine under fuzz serves the tiny model
    with a 512-token context (so no generated request decodes for long); the worker talks to a
    second engine, the scripted expert, so the gateway's episodes finish quickly."""
    work.mkdir(parents=True, exist_ok=True)
    (work / "checkpoints").mkdir(exist_ok=True)
    # A copy of the index: the dense shard takes a lock on its WAL, so a retrieval process of
    # another test (or bench) on the same kit would keep this one from starting.
    shutil.copytree(kit / "idx", work / "idx", dirs_exist_ok=True)
    ports = {name: find_free_port() for name in ("r", "rg", "e", "x", "w", "wg", "l", "c", "cg", "j", "jg")}
    env = {"BCSTACK_ADMIN_TOKEN": ADMIN_TOKEN}
    tiny = str(kit / "tiny")
    specs = [
        (["serve", "retrieval", "--index-dir", str(work / "idx"), "--port", str(ports["r"]),
          "--grpc-port", str(ports["rg"])], ports["r"]),
        (["serve", "engine", "--model", tiny, "--context-length", "512", "--port", str(ports["e"])],
         ports["e"]),
        (["serve", "engine", "--policy", "expert", "--tokenizer", tiny, "--port", str(ports["x"])],
         ports["x"]),
        (["serve", "worker", "--tokenizer", tiny, "--engine-url", _url(ports["x"]),
          "--retrieval", f"127.0.0.1:{ports['rg']}", "--checkpoint-root", str(work / "checkpoints"),
          "--port", str(ports["w"]), "--grpc-port", str(ports["wg"])], ports["w"]),
        (["serve", "coordinator-llm", "--model-name", LLM_MODEL, "--port", str(ports["l"])], ports["l"]),
        (["serve", "coordinator", "--coordinator-url", _url(ports["l"]) + "/v1",
          "--coordinator-model", LLM_MODEL, "--workers", f"127.0.0.1:{ports['wg']}",
          "--records-path", str(work / "records.sqlite"), "--port", str(ports["c"]),
          "--grpc-port", str(ports["cg"])], ports["c"]),
        (["serve", "judge", "--port", str(ports["j"]), "--grpc-port", str(ports["jg"])], ports["j"]),
    ]  # fmt: skip
    with bcstack_processes(
        [(args, _url(port) + "/health") for args, port in specs], timeout=timeout, env=env
    ):
        urls = dict(zip(SERVICES, (_url(ports[k]) for k in ("r", "e", "w", "c", "l", "j")), strict=True))
        yield FuzzStack(urls, work)


# --- the fuzzer ----------------------------------------------------------------------------------


@dataclasses.dataclass
class Problem:
    operation: str
    check: str
    message: str
    curl: str

    def __str__(self) -> str:
        return (
            f"{self.operation} [{self.check}] {self.message.strip()[:600]}\n    reproduce: {self.curl[:600]}"
        )


@dataclasses.dataclass
class FuzzReport:
    service: str
    operations: list[str]
    cases: Counter = dataclasses.field(default_factory=Counter)  # (operation, phase) -> cases sent
    statuses: Counter = dataclasses.field(default_factory=Counter)  # (operation, status) -> count
    failures: list[Problem] = dataclasses.field(default_factory=list)
    seconds: float = 0.0

    @property
    def total(self) -> int:
        return sum(self.cases.values())

    def exercised(self) -> set[str]:
        return {op for op, _ in self.cases}

    def unique_failures(self) -> list[Problem]:
        """One failure per (operation, check, first line of the message)."""
        seen: dict[tuple[str, str, str], Problem] = {}
        for f in self.failures:
            seen.setdefault((f.operation, f.check, f.message.strip().split("\n")[0][:120]), f)
        return list(seen.values())


def is_admin(operation: Any) -> bool:
    """An operation behind the admin token: its schema names a security requirement."""
    return bool(operation.definition.raw.get("security"))


def _documented(operation: Any) -> set[str]:
    return set(operation.definition.raw.get("responses", {}))


def _server_error(operation: Any, status: int) -> str | None:
    """Why a 5xx is a failure (None: it is not one). A 503 is allowed where the operation documents
    it: an upstream (grader, engine, a retriever) that cannot answer right now."""
    if status < 500 or (status == 503 and "503" in _documented(operation)):
        return None
    return f"server error {status}"


def fuzz_service(
    service: str,
    base_url: str,
    *,
    cases: int,
    examples_for: dict[str, int] | None = None,
    seed: int | None = None,
    timeout: float = 60,
) -> FuzzReport:
    """Fuzz every operation of the service at `base_url` with about `cases` generated cases.

    The cases are shared evenly by the runs: each operation positive and negative, an admin
    operation without the token and, when in `WITH_TOKEN_SAFE`, again with it. `examples_for`
    caps an operation's cases per run (e.g. `{"POST /v1/episodes": 8}` for one that runs a whole
    episode). A run whose inputs run out early (an operation with no parameters) leaves its share
    to the others, in a second round.
    """
    import hypothesis
    import schemathesis
    from hypothesis import HealthCheck, Phase
    from schemathesis.core.failures import Failure, FailureGroup
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        response_schema_conformance,
        status_code_conformance,
    )

    checks = [status_code_conformance, content_type_conformance, response_schema_conformance]
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json", timeout=timeout)
    operations = [
        op for op in (result.ok() for result in schema.get_all_operations()) if not op.path.startswith(VIEWER)
    ]
    report = FuzzReport(service, sorted(op.label for op in operations))
    session = requests.Session()
    admin_header = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    started = time.perf_counter()

    def run(operation: Any, mode: Any, with_token: bool | None, n: int) -> None:
        phase = f"{mode.value}" + ("" if with_token is None else ("+token" if with_token else "-token"))

        def fail(check: str, message: str, case: Any) -> None:
            try:
                curl = case.as_curl_command(headers=admin_header if with_token else None)
            except Exception:  # a case curl cannot express still gets reported
                curl = repr(case)
            report.failures.append(Problem(f"{operation.label} ({phase})", check, message, curl))

        @hypothesis.settings(
            max_examples=n,
            phases=[Phase.generate],
            deadline=None,
            database=None,
            derandomize=seed is None,
            suppress_health_check=list(HealthCheck),
            verbosity=hypothesis.Verbosity.quiet,
        )
        @hypothesis.given(case=operation.as_strategy(generation_mode=mode))
        def one(case: Any) -> None:
            report.cases[(operation.label, phase)] += 1
            try:
                response = case.call(
                    base_url=base_url,
                    session=session,
                    headers=admin_header if with_token else None,
                    timeout=timeout,
                )
            except requests.RequestException as exc:
                fail("transport", f"{type(exc).__name__}: {exc}", case)
                return
            report.statuses[(operation.label, response.status_code)] += 1
            if with_token is False and 200 <= response.status_code < 300:
                fail("admin_without_token", f"answered {response.status_code} without the admin token", case)
            if (why := _server_error(operation, response.status_code)) is not None:
                fail("not_a_server_error", f"{why}: {response.text[:300]}", case)
            try:
                case.validate_response(response, checks=checks)
            except FailureGroup as group:
                for failure in group.exceptions:
                    fail(failure.title, failure.message, case)
            except Failure as failure:
                fail(failure.title, failure.message, case)

        if seed is not None:
            one = hypothesis.seed(seed)(one)
        # Unsatisfiable: the negative mode of an operation with nothing to get wrong (no input).
        with contextlib.suppress(hypothesis.errors.Unsatisfiable):
            one()

    from schemathesis import GenerationMode

    runs = [
        (operation, mode, token)
        for operation in operations
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
        for token in (
            (None,)
            if not is_admin(operation)
            else (False, True)
            if operation.label in WITH_TOKEN_SAFE.get(service, set())
            else (False,)
        )
    ]
    capped = examples_for or {}
    share = -(-cases // max(1, len(runs)))
    for round_ in range(3):
        open_runs = []
        for operation, mode, token in runs:
            before = report.total
            n = capped.get(operation.label, share)
            run(operation, mode, token, n)
            if report.total - before >= n and operation.label not in capped:
                open_runs.append((operation, mode, token))
        missing = cases - report.total
        if missing <= 0 or not open_runs:
            break
        # Another round with new draws for the runs that could take more.
        runs, share, seed = open_runs, -(-missing // len(open_runs)), (seed or 0) + round_ + 1
    report.seconds = time.perf_counter() - started
    return report
