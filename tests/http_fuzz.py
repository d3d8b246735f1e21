"""Schemathesis against every service's HTTP API, with every check, on real `bcstack serve` processes.

Shared by `tests/test_http_fuzz.py` (the short version in `make test`) and `bench/fuzz_http.py`
(the long one, with a report); both run on the stack of `devkit.fuzzstack` (the admin token set):

    report = fuzz_service("judge", stack.urls["judge"], examples=4, seed=19)
    report = fuzz_service("judge", url, examples=1, cases=10_000)   # rounds until 10,000 cases

`fuzz_service` loads the service's `/openapi.json` and runs schemathesis' own engine on it, as
`st run --checks all` does: the examples, coverage, fuzzing and stateful phases, cases that fit
the schema (positive) and cases that do not (negative), every built-in check:

- no 5xx;
- the status code, content type, headers and body are the ones the operation documents;
- a schema-valid request is accepted, a schema-violating one refused (`positive_data_acceptance`,
  `negative_data_rejection`), a required header's absence refused;
- a method the schema does not list gets 405 with an `Allow` header, and OPTIONS' `Allow` lists
  exactly the documented methods (`unsupported_method`, `allow_header_conformance`);
- an operation behind the admin token never answers 2xx without it, nor with a made-up one
  (`ignored_auth`), plus the stateful checks where links between operations exist.

The few failures the services' documents allow (a documented 503, the engine's limits on fields
together) are accepted by the `filter_failure` hook of `devkit/schemathesis_hooks.py`, which
`schemathesis.toml` names, so a user's `st run` from the repository's root judges alike; the
report counts them.

Admin operations run twice: without the token (every one; the answer must be 401, or 403 for a
generated wrong token) and with it (those in `WITH_TOKEN_SAFE` only, see there). Failures do not
stop a run (`continue-on-failure`), there is no shrinking and no example database: a report lists
every problem, each with the curl command that reproduces it.
"""

from __future__ import annotations

import dataclasses
import math
import time
import tomllib
from collections import Counter
from pathlib import Path
from typing import Any

import requests

from devkit.fuzzstack import ADMIN_TOKEN, HTTP_SERVICES

SERVICES = HTTP_SERVICES
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


# Every phase `st run` has; the coverage phase is the one that sends undeclared methods and OPTIONS.
PHASES = ("examples", "coverage", "fuzzing", "stateful")
# A long fuzz is many short runs with new seeds, not one long run: Hypothesis looks for a draw it
# has not made yet, and past a few hundred examples of one operation that search costs more than
# the request (measured: ~7 cases/s for the first ~8,800 of a 3,334-per-operation retrieval run,
# then ~0.4/s, the client at 100% CPU in Hypothesis' draws and the server idle).
ROUND_EXAMPLES = 200
MAX_ROUNDS = 1_000
# The checks' settings a user's `st run` from the repository's root reads too.
CONFIG_FILE = Path(__file__).resolve().parents[1] / "schemathesis.toml"


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
    accepted: Counter = dataclasses.field(default_factory=Counter)  # operation -> failures the hook let pass
    seeds: list[int] = dataclasses.field(default_factory=list)  # one per schemathesis run
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


def _labels(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Every operation of an OpenAPI document by its label ("POST /v1/grade")."""
    return {
        f"{method.upper()} {path}": operation
        for path, operations in doc.get("paths", {}).items()
        for method, operation in operations.items()
        if isinstance(operation, dict)
    }


def _config(
    base_url: str,
    *,
    examples: int,
    seed: int,
    phases: tuple[str, ...],
    per_operation: dict[str, dict[str, Any]],
    headers: dict[str, str] | None,
    timeout: float,
) -> Any:
    """What `st run --checks all` takes from its options, as a schemathesis configuration."""
    from schemathesis.config import SchemathesisConfig

    config = SchemathesisConfig.from_dict(
        {
            **tomllib.loads(CONFIG_FILE.read_text()),
            "seed": seed,
            "suppress-health-check": ["all"],
            "output": {"sanitization": {"enabled": False}},  # a report shows what was sent
            "base-url": base_url,
            "workers": 1,
            "continue-on-failure": True,
            "request-timeout": timeout,
            "headers": headers or {},
            # No example database: without one Hypothesis keeps no Pareto front, so its target phase
            # does not spend minutes shrinking toward schemathesis' `success_rate` target (measured:
            # a retrieval round of 600 cases, 23 s, then one of >4 min in ParetoOptimiser.run).
            "generation": {"max-examples": examples, "no-shrink": True, "mode": "all", "database": "none"},
            "phases": {phase: {"enabled": phase in phases} for phase in PHASES},
            # Every check is on unless an operation's entry turns one off: `--checks all`.
            "operations": [{"include-name": label, **extra} for label, extra in per_operation.items()],
        }
    )
    return config


def fuzz_service(
    service: str,
    base_url: str,
    *,
    examples: int,
    cases: int = 0,
    examples_for: dict[str, int] | None = None,
    no_coverage: set[str] | frozenset[str] = frozenset(),
    seed: int = 0,
    timeout: float = 60,
    progress: bool = False,
) -> FuzzReport:
    """Fuzz every operation of the service at `base_url`: `examples` fuzzing-phase cases per
    operation and run (the coverage phase adds its own), and while fewer than `cases` were sent in
    all, more fuzzing rounds with new seeds on the operations that took their full share (one
    without parameters has one case to give).

    A run is the whole operation list without the token, or the service's `WITH_TOKEN_SAFE`
    operations with it. `examples_for` caps an operation's fuzzing cases per run (e.g.
    `{"POST /v1/episodes": 8}` for one that runs a whole episode per case); a capped operation
    gets no more rounds. The operations in `no_coverage` skip the coverage phase (its cases are
    not capped: every boundary and type the schema has). With `progress`, one line per run on
    stdout (the service, the run, its cases and their rate).
    """
    import schemathesis

    doc = requests.get(f"{base_url}/openapi.json", timeout=timeout).json()
    all_labels = _labels(doc)
    labels = {label: op for label, op in all_labels.items() if not label.split(" ", 1)[1].startswith(VIEWER)}
    admin = {label for label, op in labels.items() if op.get("security")}
    report = FuzzReport(service, sorted(labels))
    capped = examples_for or {}
    started = time.perf_counter()

    def run(token: bool, operations: list[str], n: int, run_seed: int, phases: tuple[str, ...]) -> Counter:
        """One schemathesis run; the fuzzing-phase cases per operation it sent."""
        # The whole document stays loaded (the methods of a path are what `Allow` must list); the
        # operations not in this run are switched off (schemathesis' own `include` is lost once
        # the configuration names operations).
        per_operation: dict[str, dict[str, Any]] = {}
        for label in all_labels:
            if label not in operations:
                per_operation[label] = {"enabled": False}
                continue
            extra: dict[str, Any] = {}
            if label in capped:
                extra["generation"] = {"max-examples": capped[label]}
            if label in no_coverage:
                extra["phases"] = {"coverage": {"enabled": False}}
            if extra:
                per_operation[label] = extra
        config = _config(
            base_url,
            examples=n,
            seed=run_seed,
            # the stateful phase follows links between operations: the run without the token has them all
            phases=tuple(p for p in phases if not (token and p == "stateful")),
            per_operation=per_operation,
            headers={"Authorization": f"Bearer {ADMIN_TOKEN}"} if token else None,
            timeout=timeout,
        )
        schema = schemathesis.openapi.from_dict(doc, config=config)
        report.seeds.append(run_seed)
        return _collect(schema, report, token=token, admin=admin)

    runs = [(False, sorted(labels)), (True, sorted(WITH_TOKEN_SAFE.get(service, set()) & set(labels)))]
    runs = [(token, ops) for token, ops in runs if ops]
    total_ops = max(1, sum(len(ops) for _, ops in runs))
    # Every run without the token comes before any with it: in the bench's 10,000-case fuzz a
    # tokenless round that followed a token run sent the token (PUT /admin/faults answered 200;
    # schemathesis kept the earlier run's headers, we suspect), a false "admin without token". So
    # the tokenless runs take rounds until `cases` were sent; the token runs, one round each.
    n_first = max(examples, min(ROUND_EXAMPLES, math.ceil(cases / total_ops)))
    for token, operations in runs:
        share = 0 if token else cases
        sent_before = report.total
        n = n_first
        round_seed = seed
        for round_ in range(MAX_ROUNDS):
            phases = PHASES if round_ == 0 else ("fuzzing",)
            run_started, total_before = time.perf_counter(), report.total
            sent = run(token, operations, n, round_seed, phases)
            if progress:
                took = time.perf_counter() - run_started
                print(
                    f"  {service}: run {len(report.seeds)} ({'token' if token else 'no token'}, "
                    f"{len(operations)} operations x {n}): {report.total - total_before} cases in "
                    f"{took:.0f} s ({(report.total - total_before) / max(took, 1e-9):.1f}/s), "
                    f"{report.total} in all",
                    flush=True,
                )
            # Another round, new draws, for the operations that took their full share.
            operations = [op for op in operations if op not in capped and sent[op] >= n]
            missing = share - (report.total - sent_before)
            if missing <= 0 or not operations:
                break
            round_seed += 1
            n = min(ROUND_EXAMPLES, math.ceil(missing / len(operations)))
    report.seconds = time.perf_counter() - started
    return report


def _collect(schema: Any, report: FuzzReport, *, token: bool, admin: set[str]) -> Counter:
    """Run schemathesis' engine on `schema` and add what it sent, saw and found to `report`."""
    from schemathesis.engine import Status, events, from_schema

    fuzzed: Counter = Counter()
    for event in from_schema(schema).execute():
        if isinstance(event, events.FatalError):
            raise RuntimeError(f"schemathesis could not run: {event.exception!r}") from event.exception
        if isinstance(event, events.NonFatalError):
            report.failures.append(Problem(event.label, "error", str(event.info.message), ""))
            continue
        if not isinstance(event, events.ScenarioFinished):
            continue
        recorder = event.recorder
        for case_id, n in recorder.filtered_failures.items():
            if case_id in recorder.cases:
                report.accepted[recorder.cases[case_id].value.operation.label] += n
        for case_id, node in recorder.cases.items():
            case = node.value
            label = case.operation.label
            phase = case.meta.phase.name.value if case.meta else "explicit"
            mode = f" {case.meta.generation.mode.value}" if case.meta else ""
            suffix = " +token" if token else (" -token" if label in admin else "")
            phase_name = f"{phase}{mode}{suffix}"
            report.cases[(label, phase_name)] += 1
            if phase == "fuzzing":
                fuzzed[label] += 1
            interaction = recorder.interactions.get(case_id)
            if interaction is None:
                continue
            if interaction.response is None:
                report.failures.append(
                    Problem(f"{label} ({phase_name})", "transport", "no response", case.as_curl_command())
                )
                continue
            status = interaction.response.status_code
            report.statuses[(label, status)] += 1
            if not token and label in admin and 200 <= status < 300:
                report.failures.append(
                    Problem(
                        f"{label} ({phase_name})",
                        "admin_without_token",
                        f"answered {status}",
                        case.as_curl_command(),
                    )
                )
            for check in recorder.checks.get(case_id, []):
                if check.status == Status.FAILURE and check.failure_info is not None:
                    failure = check.failure_info.failure
                    report.failures.append(
                        Problem(
                            f"{label} ({phase_name})",
                            check.name,
                            f"{failure.title} (answered {status}): {failure.message}",
                            check.failure_info.code_sample,
                        )
                    )
    return fuzzed
