"""The gateway's HTTP API as OpenAPI documents it: the answers of each route besides its 200.

The routes answer `{"error": "..."}` for a refusal of their own (`service._error`) and the kit's
`{"detail": [...]}` for a body that fails validation; both are documented, so `/openapi.json`
(and a fuzzer reading it) tells the truth.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, RootModel

from core.kit.http import ValidationErrorBody, json_or_sse_response


class GatewayError(BaseModel):
    error: str


class EpisodeList(BaseModel):
    episodes: list[dict[str, Any]]
    count: int


def _error(description: str, model: Any = GatewayError) -> dict[str, Any]:
    return {"description": description, "model": model}


_INVALID = _error(
    "the request cannot run (an empty or oversized question, ...) or fails validation",
    RootModel[GatewayError | ValidationErrorBody],
)

POST_EPISODE: dict[int | str, dict[str, Any]] = {
    200: json_or_sse_response(
        "the episode's result; with ?stream=true, server-sent events ending in `final`"
    ),
    409: _error("an episode with this episode_id is running now"),
    422: _INVALID,
    429: _error("the gateway runs its maximum of concurrent episodes (Retry-After)"),
    503: _error("the episode ran but its record could not be written"),
}
GET_EPISODE: dict[int | str, dict[str, Any]] = {404: _error("no recorded episode with this id")}
PUT_COORDINATOR: dict[int | str, dict[str, Any]] = {
    409: _error("the registry refused the change (unknown name to activate, ...)"),
    422: _INVALID,
}
