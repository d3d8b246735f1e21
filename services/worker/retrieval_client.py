"""The worker's client for the retrieval service (gRPC, bcstack.v1.RetrievalService).

Transient failures (UNAVAILABLE, DEADLINE_EXCEEDED, a dropped connection) are retried with
exponential backoff and jitter (tenacity); a service that is not there at all (UNAVAILABLE: it
crashed or is restarting) is retried until `unavailable_wait_s` after the first attempt, even when
the attempts are used up, so a restart does not end the episode; a document that does not exist
is an empty result, not an error; anything else, or retries running out, raises
:class:`RetrievalFailed`, which the episode runner records as an ``error`` stop.
"""

from __future__ import annotations

import grpc
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, wait_random_exponential

from core.kit.grpc_server import aio_channel
from core.protocol import Page
from core.v1 import retrieval_pb2, retrieval_pb2_grpc

RETRYABLE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}


class RetrievalFailed(RuntimeError):
    """The retrieval service could not answer (after retries)."""


class ToolInputRejected(ValueError):
    """The service refused what the model asked for (an empty or oversized query): the model is told."""


def _retryable(exc: BaseException) -> bool:
    return isinstance(exc, grpc.aio.AioRpcError) and exc.code() in RETRYABLE


class RetrievalClient:
    def __init__(
        self,
        address: str,
        *,
        timeout_s: float = 10.0,
        attempts: int = 3,
        backoff_s: float = 0.2,
        unavailable_wait_s: float = 0.0,
    ) -> None:
        self.address = address
        self.unavailable_wait_s = max(0.0, unavailable_wait_s)
        self.timeout_s = timeout_s
        self.attempts = attempts
        self.backoff_s = backoff_s
        # Made on first use: a grpc.aio channel belongs to the event loop that is running then.
        self._channel: grpc.aio.Channel | None = None
        self._stub: retrieval_pb2_grpc.RetrievalServiceStub | None = None

    @property
    def stub(self) -> retrieval_pb2_grpc.RetrievalServiceStub:
        if self._stub is None:
            self._channel = aio_channel(self.address)
            self._stub = retrieval_pb2_grpc.RetrievalServiceStub(self._channel)
        return self._stub

    def _stop(self, state: RetryCallState) -> bool:
        if state.attempt_number < self.attempts:
            return False
        exc = state.outcome.exception() if state.outcome is not None else None
        down = isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.UNAVAILABLE
        return not (down and state.seconds_since_start < self.unavailable_wait_s)

    async def _call(self, method_name: str, request):
        try:
            async for attempt in AsyncRetrying(
                retry=retry_if_exception(_retryable),
                stop=self._stop,
                wait=wait_random_exponential(multiplier=self.backoff_s, max=2.0),
                reraise=True,
            ):
                with attempt:
                    return await getattr(self.stub, method_name)(request, timeout=self.timeout_s)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:
                return None
            if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise ToolInputRejected(e.details() or "invalid request") from None
            raise RetrievalFailed(f"retrieval {self.address}: {e.code().name}: {e.details()}") from None
        raise AssertionError("unreachable")  # pragma: no cover

    async def search(self, query: str, k: int, *, snippet_words: int | None = None) -> list[Page]:
        request = retrieval_pb2.SearchRequest(query=query, k=k)
        if snippet_words is not None:
            request.snippet_words = snippet_words
        response = await self._call("Search", request)
        if response is None:
            return []
        return [Page(h.docid, h.url, h.text) for h in response.hits]

    async def open(self, docid: str | None, url: str | None) -> list[Page]:
        request = (
            retrieval_pb2.OpenRequest(docid=docid) if docid else retrieval_pb2.OpenRequest(url=url or "")
        )
        response = await self._call("Open", request)
        if response is None:
            return []
        return [Page(response.docid, response.url, response.text)]

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = self._stub = None
