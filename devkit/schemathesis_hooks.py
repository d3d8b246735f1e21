"""What schemathesis' checks report that these services' documents allow: a `filter_failure`
hook, loaded by `st run` from the repository's root (`hooks` in schemathesis.toml) and by
tests/http_fuzz.py alike, so that a user's run and the suite's judge the same way. Every check
runs on every case; only these failures are accepted (the fuzzer counts them in its report):

- `not_a_server_error` on a 503 the operation documents: an upstream (a retriever, the grader
  LLM, the model still loading) that cannot answer now (README, "Fuzzing");
- `positive_data_acceptance` on a 400 of the engine's /generate whose message is one of
  `JOINT_LIMITS`: a limit on fields together that no JSON Schema states (the prompt, as tokens,
  with max_new_tokens below the context length; min_new_tokens at most max_new_tokens;
  logprob_start_len below the prompt length). The limits one field has are in the document
  (`services.engine.openapi.document_model_limits`).
"""

from __future__ import annotations

from typing import Any

import schemathesis
from schemathesis.core.failures import ServerError
from schemathesis.openapi.checks import RejectedPositiveData

JOINT_LIMITS = {
    label: (
        "Requested token count exceeds the model's maximum context length",
        "The input (",
        "min_new_tokens must be in [0, max_new_tokens(",
        "logprob_start_len (",
    )
    for label in ("POST /generate", "PUT /generate")
}


def accepted(failure: Any, case: Any, response: Any) -> str | None:
    """Why this failure is one the service's document allows (see above), or None."""
    documented = case.operation.definition.raw.get("responses", {})
    if isinstance(failure, ServerError) and response.status_code == 503 and "503" in documented:
        return "a documented 503"
    refused = isinstance(failure, RejectedPositiveData) and response.status_code == 400
    if refused and _error_message(response).startswith(JOINT_LIMITS.get(case.operation.label, ())):
        return "a limit on fields together"
    return None


@schemathesis.hook
def filter_failure(context: Any, failure: Any, case: Any, response: Any) -> bool:
    return accepted(failure, case, response) is None


def _error_message(response: Any) -> str:
    """The message of an engine's 400 (`{"error": {"message"}}`, SGLang's shape), or ""."""
    try:
        error = response.json().get("error")
    except (ValueError, AttributeError):
        return ""
    return error.get("message", "") if isinstance(error, dict) else ""
