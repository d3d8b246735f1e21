"""One episode through the coordinator gateway, as the apps run them (evaluation, the RL loop).

    record = await run_episode(client, "http://gateway:8003", {"question": ..., "episode_id": ...})

POST /v1/episodes, then the stored typed record from GET /v1/episodes/{id}. A gateway that is full
(429) or briefly unavailable (503) is waited for, as long as its Retry-After says; one that cannot be
reached is retried with backoff a few times. Anything else is a `GatewayError` with one line.
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
) -> EpisodeRecord:
    gateway = gateway.rstrip("/")
    unreachable = 0
    for _ in range(full_attempts):
        try:
            r = await client.post(f"{gateway}/v1/episodes", json=body)
        except httpx.TransportError as e:
            unreachable += 1
            if unreachable >= unreachable_attempts:
                raise GatewayError(f"the gateway {gateway} is unreachable: {e}") from None
            await asyncio.sleep(min(2**unreachable * 0.25, 10))
            continue
        if r.status_code in (429, 503):
            await asyncio.sleep(float(r.headers.get("retry-after", "1") or 1))
            continue
        if r.status_code != 200:
            raise GatewayError(f"the gateway answered {r.status_code}: {r.text[:300]}")
        episode_id = r.json()["episode_id"]
        stored = await client.get(f"{gateway}/v1/episodes/{episode_id}")
        if stored.status_code != 200:
            raise GatewayError(f"the gateway has no record of episode {episode_id} ({stored.status_code})")
        try:
            return EpisodeRecord.load(stored.json())
        except RecordError as exc:
            raise GatewayError(f"the gateway's record of episode {episode_id} is broken: {exc}") from None
    raise GatewayError(f"the gateway {gateway} stayed full for {full_attempts} tries")
