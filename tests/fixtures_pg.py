"""A real PostgreSQL server for the tests (Debian's, started with initdb in a temporary folder by
`bcstack.pgserver`), one per test session and worker; each test that asks gets a database of its own.

    from fixtures_pg import pg_server, pg_url  # noqa: F401 (fixtures)

    def test_x(pg_url):            # a fresh, empty database on the session's server
        store = open_record_store(pg_url)
"""

from __future__ import annotations

import itertools
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from conftest import find_free_port as free_port

from bcstack.pgserver import PostgresServer

_databases = itertools.count()


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PostgresServer]:
    # Not under pytest's tmp_path: when the tests run as root the server runs as the postgres user,
    # who cannot enter root's 0700 pytest folders; mkdtemp's own folder is handed over to it.
    folder = Path(tempfile.mkdtemp(prefix="bcstack-pg-"))
    server = PostgresServer(folder, port=free_port())
    server.start()
    try:
        yield server
    finally:
        server.stop(mode="immediate")
        shutil.rmtree(folder, ignore_errors=True)


def new_database(server: PostgresServer) -> str:
    """A new empty database on `server`; its URL (password included)."""
    name = f"t{next(_databases)}"
    with psycopg.connect(server.url, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    return server.url.rsplit("/", 1)[0] + "/" + name


@pytest.fixture
def pg_url(pg_server: PostgresServer) -> str:
    return new_database(pg_server)
