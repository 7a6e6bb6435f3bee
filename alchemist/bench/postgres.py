"""A throwaway PostgreSQL server, for the tests (tests/conftest.py's ``postgres_server``: one per test run, each
test a fresh database on it, ``fresh_database``) and `alchemist bench scale` (the replicas' shared feedback log): in a
temporary directory, on 127.0.0.1 and a free port, stopped and deleted at the end.

    with postgres_server() as server:
        url = server.fresh_database()      # postgresql://postgres@127.0.0.1:PORT/NAME
    server = start_postgres(); ...; stop_postgres(server)   # the same, where start and stop are apart (tests)

PostgreSQL's programs refuse to run as root, and CI runs as root: then they run as the ``postgres`` user, on a
directory it owns. The server runs with fsync off (``-F``): it is thrown away, and nothing here tests surviving the
server's own crash. No initdb is an error, not a skip: CI's machines have PostgreSQL on the PATH (Debian:
``apt-get install postgresql``, whose programs are also looked for under /usr/lib/postgresql/*/bin).
"""

from __future__ import annotations

import glob
import itertools
import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

_names = itertools.count(1)


@dataclass(frozen=True)
class PostgresServer:
    port: int
    root: Path  # its temporary directory: the data, the socket, the log

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def fresh_database(self) -> str:
        """A new empty database's URL."""
        return fresh_database(self.url())


def fresh_database(url: str) -> str:
    """A new empty database on the server of ``url`` (a postgresql:// URL its user may create databases with), as
    that URL with the new database's name."""
    import psycopg

    name = f"test_{os.getpid()}_{next(_names)}"
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path=f"/{name}"))


def _bin_dir() -> Path:
    found = shutil.which("initdb") or next(iter(sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))[-1:]), None)
    if found is None:
        raise RuntimeError(
            "PostgreSQL's initdb is not on the PATH: the feedback log's tests run against a throwaway PostgreSQL "
            "server (install it: apt-get install postgresql)"
        )
    return Path(found).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def postgres_server() -> Iterator[PostgresServer]:
    server = start_postgres()
    try:
        yield server
    finally:
        stop_postgres(server)


def start_postgres() -> PostgresServer:
    """A new server, running; ``stop_postgres`` stops it and deletes its directory."""
    bin_dir = _bin_dir()
    root = Path(tempfile.mkdtemp(prefix="alchemist-pg-"))  # in /tmp: a directory the postgres user can reach
    if os.geteuid() == 0:  # the server refuses root
        shutil.chown(root, "postgres", "postgres")
    port = _free_port()
    try:
        _run(root, str(bin_dir / "initdb"), "-D", str(root / "data"), "-A", "trust", "-U", "postgres", "-E", "UTF8",
             "--locale=C", "--no-sync")  # fmt: skip
        options = f"-p {port} -k {root} -h 127.0.0.1 -F"
        _run(root, str(bin_dir / "pg_ctl"), "-D", str(root / "data"), "-o", options, "-l", str(root / "server.log"),
             "-w", "start")  # fmt: skip
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise
    return PostgresServer(port, root)


def stop_postgres(server: PostgresServer) -> None:
    try:
        _run(server.root, str(_bin_dir() / "pg_ctl"), "-D", str(server.root / "data"), "-m", "immediate", "-w", "stop")
    finally:
        shutil.rmtree(server.root, ignore_errors=True)


def _run(root: Path, *args: str) -> None:
    """One of PostgreSQL's programs, as the postgres user where we are root."""
    as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    result = subprocess.run([*as_user, *args], capture_output=True, text=True, timeout=120)
    if result.returncode != 0:
        log = root / "server.log"
        raise RuntimeError(f"{' '.join(args)} failed:\n{result.stdout}{result.stderr}"
                           f"{log.read_text() if log.exists() else ''}")  # fmt: skip
