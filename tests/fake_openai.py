"""A fake OpenAI-compatible chat server for tests: scripted replies, every request recorded.

    app = ScriptedLLM(503, Reply(429, headers={"Retry-After": "1"}), Reply(body=completion("hi")))
    with serving_uvicorn(uvicorn.Server(uvicorn.Config(app, port=port, lifespan="off"))): ...

Chat completions get the scripted replies in order, then `default(request_json)` (a 200 with a
fixed completion unless given); `GET …/models` lists `model`. A reply may wait `delay` seconds
first (a slow or hanging upstream), or until a test's condition `until()` holds (polled every
10 ms). Real sockets under uvicorn: nothing in the client is mocked.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from conftest import wait_until

MODEL = "scripted-coordinator"


@contextmanager
def serving_uvicorn(server: uvicorn.Server) -> Iterator[None]:
    thread = threading.Thread(target=asyncio.run, args=(server.serve(),), daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started, timeout=10, interval=0.02, message="server started")
        yield
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@dataclass
class Reply:
    status: int = 200
    body: Any = None  # dict -> JSON, bytes -> as is, None -> a completion (200) or an OpenAI error
    headers: dict[str, str] = field(default_factory=dict)
    delay: float = 0.0  # seconds to wait before answering
    until: Callable[[], bool] | None = None  # then wait until this holds (the test releases the reply)


def completion(content: Any = "<function=finish>\n<parameter=answer>Tartu</parameter>\n</function>") -> dict:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "model": MODEL,
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}
        ],
        "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10},
    }


class ScriptedLLM:
    """An OpenAI-compatible ASGI app: chat completions get the scripted replies in order, then 200s;
    GET …/models lists `model`. Every request is recorded (method, path, headers, JSON body)."""

    def __init__(
        self, *script: int | Reply, model: str = MODEL, default: Callable[[Any], Reply] | None = None
    ) -> None:
        self.script = [s if isinstance(s, Reply) else Reply(s) for s in script]
        self.model = model
        self.default = default or (lambda request: Reply())
        self.requests: list[dict[str, Any]] = []
        self.in_flight = 0
        self.max_in_flight = 0  # most chat completions being answered at once
        self.base_url = ""

    @property
    def chats(self) -> list[dict[str, Any]]:
        return [r for r in self.requests if r["path"].endswith("/chat/completions")]

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        assert scope["type"] == "http"
        raw, more = b"", True
        while more:
            message = await receive()
            raw += message.get("body", b"")
            more = message.get("more_body", False)
        headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        self.requests.append(
            {
                "method": scope["method"],
                "path": scope["path"],
                "headers": headers,
                "json": json.loads(raw) if raw else None,
            }
        )
        if scope["path"].endswith("/models"):
            reply = Reply(200, {"object": "list", "data": [{"id": self.model, "object": "model"}]})
        else:
            reply = self.script.pop(0) if self.script else self.default(self.requests[-1]["json"])
        body = reply.body
        if body is None:
            body = (
                completion()
                if reply.status == 200
                else {
                    "error": {"message": f"scripted {reply.status}", "type": "x", "param": None, "code": None}
                }
            )
        payload = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if reply.delay:
                await asyncio.sleep(reply.delay)
            while reply.until is not None and not reply.until():
                await asyncio.sleep(0.01)
        finally:
            self.in_flight -= 1
        out_headers = [(b"content-type", b"application/json")]
        out_headers += [(k.encode(), v.encode()) for k, v in reply.headers.items()]
        await send({"type": "http.response.start", "status": reply.status, "headers": out_headers})
        await send({"type": "http.response.body", "body": payload})
