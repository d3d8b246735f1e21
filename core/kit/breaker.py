"""A consecutive-failure circuit breaker for one upstream endpoint, shared by every call to it.

After `failures` consecutive failed attempts it opens and calls fail fast (no request is made)
until `reset_seconds` pass; then one trial request decides whether it closes or opens again.
The caller decides what counts: `UpstreamClient` records only failures a later attempt may fix
(429, 5xx, timeouts, connection errors, bad answers); a 4xx says nothing about the endpoint's
health and neither counts nor leaves a half-open trial hanging (`release`).
"""

from __future__ import annotations

import time
from collections.abc import Callable


class CircuitBreaker:
    """Consecutive-failure circuit breaker: closed -> open -> half_open -> closed | open.

    Not thread-safe; meant for one event loop. `on_change` gets the new state on each transition.
    """

    def __init__(
        self,
        failures: int,
        reset_seconds: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[str], None] | None = None,
    ) -> None:
        if failures < 1:
            raise ValueError(f"failures must be at least 1, got {failures}")
        if reset_seconds < 0:
            raise ValueError(f"reset_seconds must not be negative, got {reset_seconds}")
        self.failures = failures
        self.reset_seconds = reset_seconds
        self._clock = clock
        self._on_change = on_change
        self._state = "closed"
        self._consecutive = 0
        self._opened_at = 0.0
        self._trial_out = False

    @property
    def state(self) -> str:
        return self._state

    @property
    def consecutive_failures(self) -> int:
        return self._consecutive

    def retry_in(self) -> float:
        """Seconds until an open breaker lets a trial through (0 when it is not open)."""
        if self._state != "open":
            return 0.0
        return max(0.0, self._opened_at + self.reset_seconds - self._clock())

    def allow(self) -> bool:
        if self._state == "closed":
            return True
        if self._state == "open":
            if self._clock() - self._opened_at < self.reset_seconds:
                return False
            self._set("half_open")
        if self._trial_out:
            return False
        self._trial_out = True
        return True

    def record_success(self) -> None:
        self._consecutive = 0
        self._trial_out = False
        if self._state != "closed":
            self._set("closed")

    def record_failure(self) -> None:
        self._consecutive += 1
        if self._state == "half_open" or (self._state == "closed" and self._consecutive >= self.failures):
            self._trial_out = False
            self._opened_at = self._clock()
            self._set("open")

    def release(self) -> None:
        """The half-open trial ended without a verdict (a 4xx, a cancelled call): allow another."""
        if self._state == "half_open":
            self._trial_out = False

    def _set(self, state: str) -> None:
        self._state = state
        if self._on_change is not None:
            self._on_change(state)

    def __repr__(self) -> str:
        return f"CircuitBreaker(state={self._state!r}, failures={self._consecutive}/{self.failures})"
