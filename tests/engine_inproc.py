"""The CPU engine in this process, behind a transport that can take it down and bring it back.

`EngineHost` runs `EngineCore` + its FastAPI app in the test's event loop (no port, no process);
`EngineHost.transport` is an httpx transport for `EngineClient`. `kill()` stops the engine the way
a crashed SGLang server looks to its clients: requests in flight lose their connection and new
ones are refused until `restart()` starts a fresh engine (start-up weights, start-up label).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
from pydantic import SecretStr

from core.kit.metrics import new_registry
from services.engine.core import EngineCore
from services.engine.metrics import EngineMetrics
from services.engine.service import build_http_app
from services.engine.settings import EngineSettings

TOKEN = "inproc-admin-key"


class _Switchboard(httpx.AsyncBaseTransport):
    def __init__(self, host: EngineHost) -> None:
        self.host = host

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        life, app = self.host.life, self.host.app
        if app is None:
            raise httpx.ConnectError("connection refused (engine down)", request=request)
        response = await httpx.ASGITransport(app=app).handle_async_request(request)
        if self.host.life != life:  # killed while this request ran: the connection dropped
            raise httpx.RemoteProtocolError("server disconnected without a response", request=request)
        return response


class EngineHost:
    def __init__(self, model: Path, **settings: Any) -> None:
        self.model = model
        self.settings = {"admin_api_key": SecretStr(TOKEN), "max_running_requests": 16, **settings}
        self.core: EngineCore | None = None
        self.app: Any = None
        self.life = 0
        self.transport = _Switchboard(self)

    async def start(self) -> EngineHost:
        settings = EngineSettings(model=self.model, **self.settings)
        registry = new_registry()
        core = EngineCore(settings, EngineMetrics(registry))
        await core.start()
        assert core.state == "ready", core.failure
        self.core, self.app = core, build_http_app(core, settings, registry, load_on_startup=False)
        return self

    async def kill(self) -> None:
        self.life += 1
        core, self.core, self.app = self.core, None, None
        if core is not None:
            await core.close()

    async def restart(self) -> None:
        await self.kill()
        await self.start()

    async def close(self) -> None:
        await self.kill()

    def client(self, **kw: Any) -> httpx.AsyncClient:
        """A raw HTTP client on the engine (admin key sent)."""
        headers = {"Authorization": f"Bearer {TOKEN}"}
        return httpx.AsyncClient(transport=self.transport, base_url="http://engine", headers=headers, **kw)
