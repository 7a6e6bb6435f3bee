"""A throwaway PostgreSQL server, for the tests (tests/conftest.py's ``postgres_server``: one per test run, each
test a fresh database on it, ``fresh_database``) and `alchemist bench scale` (the replicas' shared feedback log): in a
temporary directory, on 127.0.0.1 and a free port, stopped and deleted at the end.

    with postgres_server() as server:
        url = server.fresh_database()      # postgresql://postgres@127.0.0.1:PORT/NAME

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

_names = itertools.count(1)


@dataclass(frozen=True)
class PostgresServer:
    port: int

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def fresh_database(self) -> str:
        """A new empty database's URL."""
        import psycopg

        name = f"test_{os.getpid()}_{next(_names)}"
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return self.url(name)


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
    bin_dir = _bin_dir()
    root = Path(tempfile.mkdtemp(prefix="alchemist-pg-"))  # in /tmp: a directory the postgres user can reach
    as_user: list[str] = []
    if os.geteuid() == 0:  # the server refuses root
        shutil.chown(root, "postgres", "postgres")
        as_user = ["runuser", "-u", "postgres", "--"]
    data, port = root / "data", _free_port()

    def run(*args: str) -> None:
        result = subprocess.run([*as_user, *args], capture_output=True, text=True, timeout=120)
        if result.returncode != 0:
            log = root / "server.log"
            raise RuntimeError(f"{' '.join(args)} failed:\n{result.stdout}{result.stderr}"
                               f"{log.read_text() if log.exists() else ''}")  # fmt: skip

    try:
        run(str(bin_dir / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres", "-E", "UTF8", "--locale=C",
            "--no-sync")  # fmt: skip
        options = f"-p {port} -k {root} -h 127.0.0.1 -F"
        run(str(bin_dir / "pg_ctl"), "-D", str(data), "-o", options, "-l", str(root / "server.log"), "-w", "start")
        try:
            yield PostgresServer(port)
        finally:
            run(str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop")
    finally:
        shutil.rmtree(root, ignore_errors=True)
