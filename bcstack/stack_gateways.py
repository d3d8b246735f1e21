"""The gateways' side of `bcstack up --records-backend postgres --gateways N`, as the chart runs them:
a PostgreSQL server of the stack's own (STATE/postgres, `bcstack.pgserver`) that every gateway
shares, and with several gateways one HAProxy front (STATE/front, `bcstack.front`) that balances
across them as a Kubernetes Service does, so the apps keep one gateway URL (stack.json's "gateway").

The server's data stays in STATE/postgres across `bcstack down` / `bcstack up`: the records survive,
as the SQLite file does. Its URL carries the password, so it reaches the gateways in their
environment only; stack.json and the output show `public_url`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bcstack.front import FrontError, HaproxyFront
from bcstack.pgserver import PostgresServer, PostgresServerError, server_bin
from bcstack.stack import StackError

POSTGRES_DIR = "postgres"
FRONT_DIR = "front"


def check_programs(records_backend: str, gateways: int) -> None:
    """StackError (one line) when PostgreSQL or HAProxy is needed and missing: before anything starts."""
    try:
        if records_backend == "postgres":
            server_bin("initdb")
            server_bin("pg_ctl")
        if gateways > 1:
            HaproxyFront.binary()
    except (PostgresServerError, FrontError) as e:
        raise StackError(str(e)) from None


def start_postgres(state: Path, port: int) -> PostgresServer:
    """The stack's PostgreSQL in STATE/postgres on `port`, set up the first time, running and answering."""
    server = PostgresServer(state / POSTGRES_DIR, port=port)
    try:
        if server.running():  # left by an `up` that was killed before it could stop it: a new port now
            server.stop()
        server.start()
    except PostgresServerError as e:
        raise StackError(str(e)) from None
    return server


def postgres_of(info: dict[str, Any]) -> PostgresServer | None:
    """The PostgreSQL server a stack.json describes (None for SQLite records)."""
    entry = info.get("postgres")
    return PostgresServer(Path(entry["folder"]), port=int(entry["port"])) if entry else None


def postgres_entry(server: PostgresServer) -> dict[str, Any]:
    """What stack.json keeps of the server: no password."""
    return {"folder": str(server.folder), "port": server.port, "url": server.public_url}


def stop_postgres(server: PostgresServer) -> bool:
    """pg_ctl stop (fast); whether it was running."""
    try:
        if not server.running():
            return False
        server.stop()
    except PostgresServerError as e:
        raise StackError(str(e)) from None
    return True


def start_front(state: Path, port: int, backends: list[str]) -> HaproxyFront:
    """HAProxy on `port` over the gateways' `host:port`s, answering once one of them is healthy."""
    front = HaproxyFront(state / FRONT_DIR, port=port, backends=backends)
    try:
        front.start()
    except FrontError as e:
        front.stop()
        raise StackError(str(e)) from None
    return front
