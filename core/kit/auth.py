"""Admin endpoint guard: `Authorization: Bearer $BCSTACK_ADMIN_TOKEN`.

With no token configured admin endpoints are disabled (403), never open. The token is
compared in constant time and never appears in a response or a log line.

    @app.post("/admin/reload", dependencies=[Depends(require_admin)])

`create_app` puts the service's token on `app.state.admin_token`; an app built otherwise can set
that attribute itself (a `SecretStr` or None).
"""

from __future__ import annotations

import secrets

from fastapi import HTTPException, Request, Security, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import SecretStr

ADMIN_DISABLED_DETAIL = "admin endpoints are disabled: no admin token is configured (set BCSTACK_ADMIN_TOKEN)"
MISSING_DETAIL = "admin endpoint: send Authorization: Bearer <admin token>"
WRONG_DETAIL = "admin endpoint: invalid admin token"


def token_matches(presented: str, expected: SecretStr) -> bool:
    """Constant-time comparison (bytes, so non-ASCII tokens are fine)."""
    return secrets.compare_digest(presented.encode("utf-8"), expected.get_secret_value().encode("utf-8"))


def bearer_token(request: Request) -> str | None:
    """The token of an `Authorization: Bearer <token>` header; None if absent or another scheme."""
    header = request.headers.get("authorization")
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


# Declares the bearer scheme in each admin operation's OpenAPI `security` (so a client, or the
# fuzzer of tests/http_fuzz.py, can tell admin operations apart); the check itself is below.
_ADMIN_SCHEME = HTTPBearer(auto_error=False, scheme_name="admin", description="BCSTACK_ADMIN_TOKEN")


async def require_admin(
    request: Request, _declared: HTTPAuthorizationCredentials | None = Security(_ADMIN_SCHEME)
) -> None:
    """FastAPI dependency: 403 when disabled, 401 without credentials, 403 on a wrong token."""
    expected: SecretStr | None = getattr(request.app.state, "admin_token", None)
    if expected is None or not expected.get_secret_value():
        raise HTTPException(status.HTTP_403_FORBIDDEN, detail=ADMIN_DISABLED_DETAIL)
    presented = bearer_token(request)
    if presented is None:
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED, detail=MISSING_DETAIL, headers={"WWW-Authenticate": "Bearer"}
        )
    if not token_matches(presented, expected):
        raise HTTPException(status.HTTP_403_FORBIDDEN, detail=WRONG_DETAIL)
