"""Helpers for the replica tests: `alchemist serve --replicas 2` started as a user starts it, on the test run's Ray
cluster and a fresh database of its PostgreSQL server (tests/conftest.py), and the front's view of its replicas."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from alchemist.bench import http_calls
from alchemist.bench.serving import stop_process
from tests.server.conftest import ServerProcess, launch_server, wait_ready

START_TIMEOUT_S = 240.0


@contextmanager
def running_front(tmp: Path, postgres_url: str, ray_address: str, flags: list[str], dtype: str = "float32",
                  training: bool = False) -> Iterator[ServerProcess]:  # fmt: skip
    """A front and two replicas, until the block ends: once both serve (and, with ``training``, train together)."""
    flags = ["--replicas", "2", "--ray-address", ray_address, "--feedback-db", postgres_url, *flags]
    front = launch_server("front", tmp, tmp / "data", flags, dtype=dtype)
    try:
        wait_ready(front)
        wait_replicas(front, 2)
        if training:
            wait_training(front)
        yield front
    finally:
        stop_process(front.process)


def replicas(front: ServerProcess) -> list[dict]:
    return http_calls.get(front.base_url + "/v1/replicas", headers=front.headers, timeout=10).json()["data"]


def wait_replicas(front: ServerProcess, ready: int, timeout_s: float = START_TIMEOUT_S, changed_pid: int = 0) -> list:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if front.process.poll() is not None:
            raise RuntimeError(f"front exited with {front.process.returncode}:\n{front.log_path.read_text()}")
        try:
            states = replicas(front)
        except httpx.TransportError:
            states = []
        if sum(r["state"] == "ready" and r["pid"] != changed_pid for r in states) >= ready:
            return states
        time.sleep(0.5)
    raise AssertionError(f"{ready} replicas not ready after {timeout_s} s: {states}\n{front.log_path.read_text()}")


def wait_training(front: ServerProcess, after_generation: int = 1) -> list[dict]:
    """The replicas, once both train together in one group of generation ``after_generation`` or later."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        states = replicas(front)
        together = all(r["training"] == "on" for r in states) and len({r["generation"] for r in states}) == 1
        if together and states[0]["generation"] >= after_generation:
            return states
        time.sleep(0.5)
    raise AssertionError(f"the replicas do not train together: {states}\n{front.log_path.read_text()}")
