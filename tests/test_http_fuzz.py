"""Every service's HTTP API against schemathesis, with real `bcstack serve` processes on the toy kit.

For each service: every operation of its `/openapi.json` is exercised, at least `CASES` generated
cases in all (positive and negative; admin operations without and with the token), and not one
of them finds a 5xx other than a documented 503, an answer that does not match the documented
status codes, content types and schemas, or an admin operation that succeeds without the token.
`tests/http_fuzz.py` has the fuzzer; `bench/fuzz_http.py` runs a longer version with a report.
"""

from __future__ import annotations

import pytest
import requests
from http_fuzz import ADMIN_TOKEN, SERVICES, fuzz_service, fuzz_stack, is_admin

CASES = 1000  # generated cases per service, at least
# The gateway's POST /v1/episodes runs a whole episode per accepted case (coordinator LLM, worker,
# engine, retrieval): a few accepted ones prove the path; the negative cases are cheap and many.
SLOW = {"coordinator": {"POST /v1/episodes": 8}}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(tmp_path_factory, toy_kit):
    with fuzz_stack(toy_kit["dir"], tmp_path_factory.mktemp("fuzz")) as running:
        yield running


@pytest.mark.parametrize("service", SERVICES)
def test_every_operation_holds_against_generated_requests(stack, service):
    report = fuzz_service(service, stack.urls[service], cases=CASES, examples_for=SLOW.get(service), seed=19)
    assert not report.failures, f"{len(report.failures)} problem(s):\n" + "\n".join(
        str(f) for f in report.unique_failures()
    )
    assert report.exercised() == set(report.operations)
    assert report.total >= CASES, report.cases


@pytest.mark.parametrize("service", SERVICES)
def test_the_openapi_document_is_served_and_names_admin_operations(stack, service):
    import schemathesis

    schema = schemathesis.openapi.from_url(f"{stack.urls[service]}/openapi.json")
    admin = {op.label for op in (r.ok() for r in schema.get_all_operations()) if is_admin(op)}
    for label in admin:
        method, path = label.split(" ", 1)
        refused = requests.request(method, stack.urls[service] + path, timeout=30)
        assert refused.status_code == 401, (label, refused.text)
        wrong = requests.request(method, stack.urls[service] + path, timeout=30,
                                 headers={"Authorization": f"Bearer not-{ADMIN_TOKEN}"})  # fmt: skip
        assert wrong.status_code == 403, (label, wrong.text)
    expected = {"engine": 5, "worker": 2, "coordinator": 2, "coordinator-llm": 2}
    assert len(admin) >= expected.get(service, 0)
