"""The gateway's episode viewer over HTTP: `GET /ui` (the record list) and `GET /ui/episodes/{id}`.

Read-only, server-rendered (Jinja templates and a little CSS/JS in this package: no CDN, it works
offline). The pages render `services.coordinator.viewer`'s view-models; this module only routes,
checks the token and picks the status code.

Access (docs/guide/viewer.md): when a viewer token (`BCSTACK_COORDINATOR_VIEWER_TOKEN`) or the
admin token is configured, a request needs one of them: `Authorization: Bearer <token>`, or the
HttpOnly cookie that `/ui?token=<token>` sets once (a browser cannot send a bearer header from a
link), after which the token is dropped from the address bar by a redirect. With neither token
configured the viewer is open, as `GET /v1/episodes/{id}` is: it shows nothing that API does not.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
from importlib.resources import files
from typing import Any
from urllib.parse import urlencode

import jinja2
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from pydantic import SecretStr

from core.kit.auth import bearer_token, token_matches
from core.records import RecordError
from services.coordinator import episode_list, viewer
from services.coordinator.gateway import GatewayCore

COOKIE = "bcstack_viewer"
# The cookie holds an HMAC of the token, not the token: a copied cookie is no bearer credential,
# and changing the token ends every session.
_COOKIE_CONTEXT = b"bcstack-viewer-cookie/1"
COOKIE_MAX_AGE_SECONDS = 7 * 24 * 3600

_templates = jinja2.Environment(
    loader=jinja2.PackageLoader("services.coordinator", "templates"),
    autoescape=jinja2.select_autoescape(("html",)),
    undefined=jinja2.StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
)


def _page(description: str) -> dict[str, Any]:
    return {"description": f"{description} (an HTML page)", "content": {"text/html": {}}}


# Documented, so a client (or the OpenAPI fuzzer, tests/http_fuzz.py) knows what a refusal looks like.
_ACCESS_RESPONSES: dict[int | str, dict[str, Any]] = {
    303: {"description": "`?token=` was right: its cookie is set; the same page without the token follows"},
    401: _page("a token is configured and none was sent (a form asks for it)"),
    403: _page("the token sent is neither the viewer's nor the admin token"),
}


def _cookie_value(token: SecretStr) -> str:
    return hmac.new(token.get_secret_value().encode("utf-8"), _COOKIE_CONTEXT, hashlib.sha256).hexdigest()


def _tokens(request: Request, viewer_token: SecretStr | None) -> list[SecretStr]:
    admin: SecretStr | None = getattr(request.app.state, "admin_token", None)
    return [t for t in (viewer_token, admin) if t is not None and t.get_secret_value()]


def _html(request: Request, template: str, **context: Any) -> str:
    return _templates.get_template(template).render(root=request.scope.get("root_path", ""), **context)


def _render(request: Request, template: str, status: int = 200, **context: Any) -> HTMLResponse:
    return HTMLResponse(_html(request, template, **context), status_code=status)


def _message(request: Request, status: int, title: str, message: str, **context: Any) -> HTMLResponse:
    context.setdefault("ask_token", False)
    return _render(request, "message.html", status, title=title, message=message, **context)


def add_viewer(app: FastAPI, core: GatewayCore, decoder: viewer.TokenDecoder | None) -> None:
    """Mount the viewer's routes and static files on the gateway's app."""
    viewer_token = core.settings.viewer_token
    static = files("services.coordinator") / "static"
    app.mount("/ui/static", StaticFiles(directory=str(static)), name="viewer-static")

    def refused(request: Request) -> Response | None:
        """None when the request may see the viewer; else the page that says why not."""
        tokens = _tokens(request, viewer_token)
        if not tokens:
            return None
        presented = bearer_token(request)
        if presented is not None:
            if any(token_matches(presented, t) for t in tokens):
                return None
            return _message(request, 403, "Wrong token", "The bearer token is not the viewer's token.")
        offered = request.query_params.get("token")
        if offered:
            match = next((t for t in tokens if token_matches(offered, t)), None)
            if match is None:
                return _message(
                    request, 403, "Wrong token", "That token is not the viewer's token.", ask_token=True
                )
            rest = urlencode([(k, v) for k, v in request.query_params.multi_items() if k != "token"])
            target = request.url.path + (f"?{rest}" if rest else "")
            redirect = RedirectResponse(target, status_code=303)
            redirect.set_cookie(
                COOKIE,
                _cookie_value(match),
                max_age=COOKIE_MAX_AGE_SECONDS,
                path=request.scope.get("root_path", "") + "/ui",
                httponly=True,
                samesite="strict",
                secure=request.url.scheme == "https",
            )
            return redirect
        cookie = request.cookies.get(COOKIE)
        if cookie and any(hmac.compare_digest(cookie, _cookie_value(t)) for t in tokens):
            return None
        page = _message(
            request,
            401,
            "Token required",
            "This viewer needs the viewer token (or the admin token): send Authorization: Bearer <token>, "
            "or enter it below once; the browser then keeps an HttpOnly cookie.",
            ask_token=True,
        )
        page.headers["WWW-Authenticate"] = "Bearer"
        return page

    @app.get(
        "/ui",
        response_class=HTMLResponse,
        summary="Episode viewer: the list of recorded episodes",
        responses=_ACCESS_RESPONSES,
    )
    async def ui_list(request: Request) -> Response:
        if (refusal := refused(request)) is not None:
            return refusal
        params = {k: v for k, v in request.query_params.items() if len(v) <= 256}

        def page() -> str:  # SQLite and the template off the event loop, which runs episodes
            view = episode_list.list_view(core.store, params)
            return _html(request, "list.html", view=view, graded_choices=episode_list.GRADED_CHOICES)

        return HTMLResponse(await asyncio.to_thread(page))

    @app.get(
        # :path so that an id with a slash still reaches this route and its 404 page
        "/ui/episodes/{episode_id:path}",
        response_class=HTMLResponse,
        summary="Episode viewer: one recorded episode",
        responses={
            **_ACCESS_RESPONSES,
            # The router's own JSON 404 answers an id no route pattern takes (one with a newline).
            404: {
                "description": "no recorded episode with that id (an HTML page)",
                "content": {"text/html": {}, "application/json": {}},
            },
        },
    )
    async def ui_episode(request: Request, episode_id: str) -> Response:
        if (refusal := refused(request)) is not None:
            return refusal
        try:
            record = await core.stored(episode_id)
        except RecordError as exc:
            return _message(request, 500, "Unreadable record", str(exc))
        if record is None:
            return _message(
                request, 404, "No such episode", f"No recorded episode has the id {episode_id!r}."
            )
        # Decoding and rendering a long episode take a fraction of a second (8 branches of 18K tokens:
        # 0.7 s, 1.7 MB): off the event loop.
        html = await asyncio.to_thread(
            lambda: _html(request, "episode.html", view=viewer.episode_view(record, decoder))
        )
        return HTMLResponse(html)
