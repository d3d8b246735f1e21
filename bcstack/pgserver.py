"""A PostgreSQL server of its own in a folder: what `bcstack up --records postgres` runs for its
gateways, and what the tests start for the PostgreSQL record store.

    server = PostgresServer(state / "postgres", port=5433)
    server.start()            # initdb on first use, then pg_ctl start; waits until it answers
    store = open_record_store(server.url)
    server.stop()

It uses the server binaries of the machine's PostgreSQL (Debian's `postgresql` package puts them in
/usr/lib/postgresql/<version>/bin; `make install-test` installs it), found on PATH or there. The
cluster listens on 127.0.0.1 and on a Unix socket inside its folder; host connections need the
password (scram-sha-256), written once to `<folder>/password` (mode 0600) and read from there.
PostgreSQL refuses to run as root: when bcstack runs as root (a container, CI), the server runs as
the `postgres` system user, who then owns the folder.

Written here rather than taken from a library: the Python packages that start a throwaway server
(testing.postgresql, pytest-postgresql) are test fixtures, not something `bcstack up` can keep in
a state folder across restarts, and this is a few calls of initdb and pg_ctl.
"""

from __future__ import annotations

import os
import pwd
import secrets
import shutil
import subprocess
import time
from pathlib import Path

import psycopg

DATABASE = "bcstack"
USER = "bcstack"
SERVICE_USER = "postgres"


class PostgresServerError(RuntimeError):
    """The server cannot be set up, started or stopped (one line)."""


def server_bin(name: str) -> Path:
    """A PostgreSQL server program: on PATH, else the newest /usr/lib/postgresql/*/bin."""
    found = shutil.which(name)
    if found:
        return Path(found)
    candidates = sorted(
        Path("/usr/lib/postgresql").glob(f"*/bin/{name}"),
        key=lambda p: int(p.parts[-3]) if p.parts[-3].isdigit() else 0,
    )
    if not candidates:
        raise PostgresServerError(
            f"PostgreSQL's {name} is not installed: `make install-test` adds Debian's postgresql package "
            "(or apt-get install postgresql)"
        )
    return candidates[-1]


class PostgresServer:
    def __init__(self, folder: Path, *, port: int, host: str = "127.0.0.1") -> None:
        self.folder = Path(folder).resolve()
        self.data = self.folder / "data"
        self.port = port
        self.host = host
        self._as_service_user = os.geteuid() == 0

    @property
    def password(self) -> str:
        return (self.folder / "password").read_text().strip()

    @property
    def url(self) -> str:
        """The connection URL, password included (a secret: print `public_url`)."""
        return f"postgresql://{USER}:{self.password}@{self.host}:{self.port}/{DATABASE}"

    @property
    def public_url(self) -> str:
        return f"postgresql://{USER}@{self.host}:{self.port}/{DATABASE}"

    def _run(self, args: list[str], *, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        kwargs: dict = {}
        if self._as_service_user:
            entry = pwd.getpwnam(SERVICE_USER)
            kwargs = {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []}
        try:
            return subprocess.run(
                args, capture_output=True, text=True, timeout=timeout, check=True, cwd=self.folder, **kwargs
            )
        except subprocess.CalledProcessError as exc:
            last = (exc.stderr or exc.stdout or "").strip().splitlines()
            raise PostgresServerError(
                f"{Path(args[0]).name} failed in {self.folder}: {last[-1] if last else exc.returncode}"
            ) from None
        except subprocess.TimeoutExpired:
            raise PostgresServerError(
                f"{Path(args[0]).name} took over {timeout:g} s in {self.folder}"
            ) from None

    def _own(self, path: Path) -> None:
        if self._as_service_user:
            entry = pwd.getpwnam(SERVICE_USER)
            os.chown(path, entry.pw_uid, entry.pw_gid)

    def init(self) -> None:
        """initdb with a password for host connections, once (a folder already set up is kept)."""
        if (self.data / "PG_VERSION").exists():
            return
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise PostgresServerError(f"cannot create {self.folder}: {exc}") from None
        if self._as_service_user:
            try:
                pwd.getpwnam(SERVICE_USER)
            except KeyError:
                raise PostgresServerError(
                    "PostgreSQL refuses to run as root and there is no 'postgres' user to run it as"
                ) from None
        self._own(self.folder)
        os.chmod(self.folder, 0o700)
        if self._as_service_user:
            for parent in self.folder.parents:
                if not parent.stat().st_mode & 0o001:
                    raise PostgresServerError(
                        f"the PostgreSQL folder {self.folder} must be reachable by the '{SERVICE_USER}' "
                        f"user (root runs the server as it), but {parent} is not searchable by others: "
                        "choose a state folder outside it"
                    )
        password_file = self.folder / "password"
        password_file.write_text(secrets.token_urlsafe(24) + "\n")
        os.chmod(password_file, 0o600)
        self._own(password_file)
        self._run(
            [str(server_bin("initdb")), "--pgdata", str(self.data), "--username", USER, "--pwfile",
             str(password_file), "--auth-host", "scram-sha-256", "--auth-local", "peer", "--encoding", "UTF8",
             "--no-instructions"],
        )  # fmt: skip
        with (self.data / "postgresql.conf").open("a") as conf:
            conf.write(
                "\n# bcstack up: loopback and a socket in the folder\n"
                f"listen_addresses = '{self.host}'\nunix_socket_directories = '{self.folder}'\n"
                "max_connections = 200\n"
            )

    def running(self) -> bool:
        if not (self.data / "postmaster.pid").exists():
            return False
        try:
            self._run([str(server_bin("pg_ctl")), "status", "--pgdata", str(self.data)], timeout=30)
        except PostgresServerError:
            return False
        return True

    def start(self, *, timeout: float = 60) -> None:
        """Set up (first time), start and wait until the database answers; creates it once."""
        self.init()
        if not self.running():
            self._run(
                [str(server_bin("pg_ctl")), "start", "--pgdata", str(self.data), "--wait", "--timeout",
                 str(int(timeout)), "--log", str(self.folder / "server.log"), "-o", f"-p {self.port}"],
                timeout=timeout + 10,
            )  # fmt: skip
        deadline = time.monotonic() + timeout
        while True:
            try:
                with psycopg.connect(
                    self.url.rsplit("/", 1)[0] + "/postgres", autocommit=True, connect_timeout=5
                ) as conn:
                    if (
                        conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (DATABASE,)).fetchone()
                        is None
                    ):
                        conn.execute(f"CREATE DATABASE {DATABASE} OWNER {USER}")
                return
            except psycopg.OperationalError as exc:
                if time.monotonic() > deadline:
                    raise PostgresServerError(
                        f"PostgreSQL in {self.folder} did not answer within {timeout:g} s: "
                        f"{' '.join(str(exc).split())[:200]}"
                    ) from None
                time.sleep(0.2)

    def stop(self, *, mode: str = "fast") -> None:
        """pg_ctl stop (fast: disconnects clients, a clean shutdown); nothing when not running."""
        if self.running():
            self._run(
                [str(server_bin("pg_ctl")), "stop", "--pgdata", str(self.data), "--mode", mode, "--wait"]
            )

    def __enter__(self) -> PostgresServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
