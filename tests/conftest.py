"""Shared fixtures: tiny random Llama-family checkpoints saved as real HF directories, and the default model."""

from __future__ import annotations

import json
import os
import re
import secrets
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from alchemist.model.gguf import default_cache_dir
from tests.tiny_models import TINY_VARIANTS, make_tiny_hf_dir

# The run's compiled kernels where a server started alone keeps them ($ALCHEMIST_CACHE/inductor): torch sets
# TORCHINDUCTOR_CACHE_DIR in a process the first time it compiles (to /tmp/torchinductor_<user>), and every server a
# worker started after that would inherit it, so that an empty $ALCHEMIST_CACHE did not make a run compile what a
# fresh machine compiles.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(default_cache_dir() / "inductor"))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The modules marked slow first, in the order collected, then the others: `make test`'s two workers take a file
    at a time in this order (``--no-loadscope-reorder``: pytest-xdist would put the files of most tests first), and
    a long module started last would run on alone."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {v: make_tiny_hf_dir(root, v) for v in TINY_VARIANTS}


@pytest.fixture(scope="session")
def smollm2():
    """The real default model, SmolLM2-135M-Instruct, in fp32 (the exactness reference), loaded once."""
    from alchemist.model.loader import load_model

    return load_model(None, dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2):
    return smollm2.tokenizer


# --- services the whole run shares -------------------------------------------------------------------------------
# A throwaway PostgreSQL server and a local Ray cluster start once per test run, `make test`'s two workers included:
# the first test that asks starts one (under a file lock in the run's temporary directory, which the workers share)
# and writes how to reach it there; the run's end stops it (pytest_sessionfinish in the controller, after every
# worker: a worker that ran out of files must not stop what the other still uses).


def _run_dir(config: pytest.Config) -> Path:
    """The run's own temporary directory: the workers' parent (theirs are popen-gwN in it), or the single process's."""
    base = config._tmp_path_factory.getbasetemp()  # type: ignore[attr-defined]  # pytest's tmp_path_factory
    return base.parent if hasattr(config, "workerinput") else base


def _run_wide(config: pytest.Config, name: str, start) -> dict:
    """Service ``name``'s description (a JSON object), from the run's directory, or from ``start()`` once."""
    from filelock import FileLock

    root = _run_dir(config)
    described = root / f"{name}.json"
    with FileLock(str(root / f"{name}.lock")):
        if not described.exists():
            described.write_text(json.dumps(start()))
        return json.loads(described.read_text())


def _start_ray() -> dict:
    """A local Ray head (``ray start``) on this machine's cores, counted four times over: each replica's torch
    threads are its own setting (alchemist.scale.serve.replica_cpus), and two test modules' replicas may share it.
    Token authentication on, with a token of the run's own (``ray_address`` hands it to the processes that join)."""
    port = _free_port()
    cpus = 4 * (os.cpu_count() or 1)
    token = secrets.token_hex(32)
    started = subprocess.run([_ray(), "start", "--head", f"--port={port}", f"--num-cpus={cpus}",
                              "--include-dashboard=false", "--disable-usage-stats",
                              f"--object-store-memory={80 << 20}"],
                             env=os.environ | _ray_auth(token), check=True, capture_output=True, text=True,
                             timeout=180)  # fmt: skip
    # Ray binds the node's address, not the loopback: the address to join is the one it prints.
    address = re.search(r"--address='([^']+)'", started.stdout + started.stderr)
    assert address is not None, started.stdout + started.stderr
    return {"address": address.group(1), "token": token}


def _ray_auth(token: str) -> dict[str, str]:
    """The environment that starts or joins a cluster with token authentication and ``token``: given as a variable,
    not in ~/.ray/auth_token, which a fresh machine lacks (its `ray start` then fails) and another run may hold."""
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}


def _ray() -> str:
    """Ray's command, beside this Python (a virtual environment's bin is not always on the PATH: `make test`)."""
    beside = Path(sys.executable).parent / "ray"
    return str(beside) if beside.exists() else "ray"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pytest_sessionfinish(session: pytest.Session) -> None:
    if hasattr(session.config, "workerinput"):
        return  # a worker: the controller stops the services once every worker is done
    root = _run_dir(session.config)
    if (root / "ray.json").exists():
        subprocess.run([_ray(), "stop", "--force"], capture_output=True, timeout=120)
    if (root / "postgres.json").exists():
        from alchemist.bench.postgres import PostgresServer, stop_postgres

        described = json.loads((root / "postgres.json").read_text())
        stop_postgres(PostgresServer(described["port"], Path(described["root"])))


@pytest.fixture(scope="session")
def postgres_server(request: pytest.FixtureRequest):
    """One throwaway PostgreSQL server for the whole test run (alchemist/bench/postgres.py)."""
    from alchemist.bench.postgres import PostgresServer, start_postgres

    def start() -> dict:
        server = start_postgres()
        return {"port": server.port, "root": str(server.root)}

    described = _run_wide(request.config, "postgres", start)
    return PostgresServer(described["port"], Path(described["root"]))


@pytest.fixture(scope="session")
def ray_address(request: pytest.FixtureRequest) -> Iterator[str]:
    """One local Ray cluster for the whole test run: what `alchemist serve --ray-address` joins, with the run's
    token set for this worker and the processes it starts (a driver without it is refused)."""
    described = _run_wide(request.config, "ray", _start_ray)
    with pytest.MonkeyPatch.context() as patch:
        for name, value in _ray_auth(described["token"]).items():
            patch.setenv(name, value)
        yield described["address"]


@pytest.fixture
def postgres_url(postgres_server) -> str:
    """A fresh empty database on the session's server, as a postgresql:// URL."""
    return postgres_server.fresh_database()
