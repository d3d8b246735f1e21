"""One episode through the coordinator gateway, as the apps run them (evaluation, the RL loop).

    record = await run_episode(client, "http://gateway:8003", {"question": ..., "episode_id": ...})

POST /v1/episodes, then the stored typed record from GET /v1/episodes/{id}. A gateway that is full
(429) or briefly unavailable (503) is waited for, as long as its Retry-After says; one that cannot be
reached (refused, or a connection dropped mid-episode: a crashed or restarting gateway) is retried
with backoff `unreachable_attempts` times, or for `unreachable_wait_s` seconds when that is given.
A 409 (the gateway is still running this episode id for an earlier request whose connection
dropped) is waited for the same way, and so is a 502 or 504 from a front whose replica went away.
Retrying is safe because the body's `episode_id` makes it one episode: the gateway answers a
recorded id from its records and runs an unrecorded one afresh.
Anything else is a `GatewayError` with one line.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from core.records import EpisodeRecord, RecordError


class GatewayError(RuntimeError):
    """The gateway refused the episode, could not be reached, or stored a broken record."""


async def run_episode(
    client: httpx.AsyncClient,
    gateway: str,
    body: dict[str, Any],
    *,
    full_attempts: int = 60,
    unreachable_attempts: int = 8,
    unreachable_wait_s: float | None = None,
) -> EpisodeRecord:
    gateway = gateway.rstrip("/")
    unreachable = 0
    away_since: float | None = None  # the start of the current outage (loop.time())
    loop = asyncio.get_running_loop()

    async def away(what: str) -> None:
        """Wait before the next try, or GatewayError once the outage outlasted its allowance."""
        nonlocal unreachable, away_since
        unreachable += 1
        away_since = loop.time() if away_since is None else away_since
        if unreachable_wait_s is None:
            if unreachable >= unreachable_attempts:
                raise GatewayError(f"the gateway {gateway} is unreachable: {what}")
        elif loop.time() - away_since >= unreachable_wait_s:
            raise GatewayError(
                f"the gateway {gateway} was unreachable for {loop.time() - away_since:.0f} s: {what}"
            )
        await asyncio.sleep(min(2**unreachable * 0.25, 5 if unreachable_wait_s is not None else 10))

    full = 0
    while full < full_attempts:
        try:
            r = await client.post(f"{gateway}/v1/episodes", json=body)
        except httpx.TransportError as e:
            await away(str(e) or type(e).__name__)
            continue
        if r.status_code == 409 and body.get("episode_id"):
            await away(f"episode {body['episode_id']} is still running there")
            continue
        if r.status_code in (502, 504) and body.get("episode_id"):
            # A front (a load balancer, a Service's proxy) lost the replica running it: again, the
            # same id, on another one.
            await away(f"the front answered {r.status_code}")
            continue
        unreachable, away_since = 0, None
        if r.status_code in (429, 503):
            full += 1
            await asyncio.sleep(float(r.headers.get("retry-after", "1") or 1))
            continue
        if r.status_code != 200:
            raise GatewayError(f"the gateway answered {r.status_code}: {r.text[:300]}")
        episode_id = r.json()["episode_id"]
        try:
            stored = await client.get(f"{gateway}/v1/episodes/{episode_id}")
        except httpx.TransportError as e:
            if not body.get("episode_id"):
                raise GatewayError(
                    f"the gateway {gateway} went away before episode {episode_id} was read"
                ) from None
            await away(str(e) or type(e).__name__)  # recorded: the next POST answers from the records
            continue
        if stored.status_code in (502, 503, 504) and body.get("episode_id"):
            # The front lost the replica it sent the read to (killed between the answer and the
            # read), or the replica cannot reach the store for now: the episode is recorded, so the
            # next POST of the same id answers from the records, on any replica.
            await away(f"reading episode {episode_id}: the gateway answered {stored.status_code}")
            continue
        if stored.status_code != 200:
            raise GatewayError(f"the gateway has no record of episode {episode_id} ({stored.status_code})")
        try:
            return EpisodeRecord.load(stored.json())
        except RecordError as exc:
            raise GatewayError(f"the gateway's record of episode {episode_id} is broken: {exc}") from None
    raise GatewayError(f"the gateway {gateway} stayed full for {full_attempts} tries")
