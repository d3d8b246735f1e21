"""`bcstack.gateway_client.run_episode` against a front that loses a replica between the answer
and the read: the read's 502 is an outage to wait out (the episode is recorded, so the same id
posted again answers from the records), not "no record". tests/test_gateway_replicas.py kills a
real replica behind HAProxy; this pins the one ordering it hits only sometimes."""

from __future__ import annotations

import asyncio

import httpx
from viewer_records import plain_record

from bcstack.gateway_client import run_episode


def test_a_read_the_front_answers_502_is_retried_with_the_same_id() -> None:
    record = plain_record("ep-7").dump()
    calls: list[tuple[str, str]] = []

    def front(request: httpx.Request) -> httpx.Response:
        calls.append((request.method, request.url.path))
        if request.method == "POST":
            return httpx.Response(200, json={"episode_id": "ep-7", "status": record["status"]})
        reads = sum(1 for method, _ in calls if method == "GET")
        if reads == 1:
            return httpx.Response(502, text="<html>502 Bad Gateway</html>")  # the replica was killed
        return httpx.Response(200, json=record)

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(front)) as client:
            return await run_episode(
                client, "http://front", {"question": "q", "episode_id": "ep-7"}, unreachable_wait_s=30
            )

    got = asyncio.run(go())
    assert got.episode_id == "ep-7"
    assert calls == [("POST", "/v1/episodes"), ("GET", "/v1/episodes/ep-7")] * 2
