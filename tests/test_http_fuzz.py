"""Every service's HTTP API against schemathesis with every check, on the fuzz stack's processes.

For each service, every operation of its `/openapi.json` gets generated cases, positive and
negative, from the coverage phase (each boundary and wrong type the schema has, undeclared
methods, OPTIONS) and a few from the fuzzing phase; admin operations without the token and, where
safe, with it (`tests/http_fuzz.py`). Not one case may fail a schemathesis check: a 5xx other than
a documented 503, an answer the schema does not document, a schema-valid request refused or a
schema-violating one accepted, an `Allow` that is not the path's methods, an admin operation that
answers 2xx without the token. `bench/fuzz_http.py` runs the long version (10,000 cases per
service) with a report; what the fuzzing found is pinned in `tests/test_http_schemas.py`.
"""

from __future__ import annotations

import pytest
import requests
from http_fuzz import SERVICES, WITH_TOKEN_SAFE, fuzz_service, is_admin

from devkit.fuzzstack import ADMIN_TOKEN

EXAMPLES = 3  # fuzzing-phase cases per operation and run, beside the coverage phase's
# The gateway's POST /v1/episodes runs a whole episode per accepted case: one fuzzed case proves
# the path (the coverage phase sends its boundaries too).
SLOW = {"coordinator": {"POST /v1/episodes": 1}}
# The coverage phase of the engine's /generate sends ~300 requests, most decoding up to 128 tokens
# on the tiny model (~40 s on 2 cores); the bench runs it, and its fuzzing phase runs here.
NO_COVERAGE = {"engine": {"POST /generate", "PUT /generate"}}

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("service", SERVICES)
def test_every_operation_holds_against_generated_requests(fuzz_stack, service):
    report = fuzz_service(
        service,
        fuzz_stack.urls[service],
        examples=EXAMPLES,
        examples_for=SLOW.get(service),
        no_coverage=NO_COVERAGE.get(service, set()),
        seed=19,
    )
    assert not report.failures, f"{len(report.failures)} problem(s):\n" + "\n".join(
        str(f) for f in report.unique_failures()
    )
    phases = {op: {phase for o, phase in report.cases if o == op} for op in report.operations}
    for operation, seen in phases.items():
        assert any("positive" in p for p in seen), (operation, seen)  # every operation had cases
    assert any("negative" in p for seen in phases.values() for p in seen), report.cases
    for operation in WITH_TOKEN_SAFE.get(service, set()):
        assert any("+token" in p for p in phases[operation]), (operation, phases[operation])


@pytest.mark.parametrize("service", SERVICES)
def test_the_openapi_document_is_served_and_names_admin_operations(fuzz_stack, service):
    import schemathesis

    url = fuzz_stack.urls[service]
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    admin = {op.label for op in (r.ok() for r in schema.get_all_operations()) if is_admin(op)}
    for label in admin:
        method, path = label.split(" ", 1)
        refused = requests.request(method, url + path, timeout=30)
        assert refused.status_code == 401, (label, refused.text)
        wrong = requests.request(method, url + path, timeout=30,
                                 headers={"Authorization": f"Bearer not-{ADMIN_TOKEN}"})  # fmt: skip
        assert wrong.status_code == 403, (label, wrong.text)
    expected = {"engine": 5, "worker": 2, "coordinator": 2, "coordinator-llm": 2}
    assert len(admin) >= expected.get(service, 0)
