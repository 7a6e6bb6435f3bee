"""Real server processes (`python -m alchemist.cli serve ...` on a free localhost port), started once per session.

``server``: the default model in fp32 with roomy limits, for the OpenAI-client tests. ``small_server``: the same
model with tiny limits (one running request, one waiting, a 256-token context, 4 KiB bodies) for overload and
size errors. Both are started when the first of them is asked for, in parallel, since each load takes seconds.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from alchemist.bench import http_calls
from alchemist.model.loader import hf_dir_for
from alchemist.model.tokenizer import Tokenizer

MODEL_NAME = "smollm2"  # --served-model-name of both servers
STARTUP_TIMEOUT_S = 180.0
# No online training on these: their tests compare outputs, which a new adapter version would change.
SERVER_FLAGS = {
    "main": ["--max-num-seqs", "4", "--max-model-len", "1024", "--max-body-bytes", "262144", "--no-train"],
    "small": [
        *("--max-num-seqs", "1", "--max-waiting", "1", "--max-model-len", "256", "--max-body-bytes", "4096"),
        "--no-train",
    ],
}


@dataclass
class ServerProcess:
    base_url: str  # http://127.0.0.1:PORT
    process: subprocess.Popen
    log_path: Path
    data_dir: Path  # --data-dir: the feedback log is data_dir / "feedback.sqlite"
    api_key: str | None = None  # what client() and headers send (an admin key, where the server has keys)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, api_key: str | None = None, **kwargs) -> openai.OpenAI:
        # No retries: a 429 or 5xx must reach the test as it is.
        key = api_key or self.api_key or "unused"
        kwargs.setdefault("http_client", openai.DefaultHttpxClient(verify=http_calls.TLS))  # no CA bundle per client
        return openai.OpenAI(base_url=self.base_url + "/v1", api_key=key, max_retries=0, **kwargs)

    def metrics(self) -> dict[str, float]:
        """Unlabelled samples of /metrics, e.g. {"alchemist:num_requests_running": 0.0}."""
        text = http_calls.get(self.base_url + "/metrics", headers=self.headers, timeout=10).text
        samples = {}
        for line in text.splitlines():
            if m := re.fullmatch(r"([a-zA-Z_:]+(?:\{[^}]*\})?) (\S+)", line):
                samples[m.group(1)] = float(m.group(2))
        return samples

    def wait_for_metric(self, name: str, value: float, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while (current := self.metrics().get(name)) != value:
            if time.monotonic() > deadline:
                raise AssertionError(f"{name} is {current}, expected {value} within {timeout_s} s")
            time.sleep(0.05)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(name: str, log_dir: Path) -> ServerProcess:
    return launch_server(name, log_dir, log_dir / f"{name}-data", SERVER_FLAGS[name])


def launch_server(
    name: str, log_dir: Path, data_dir: Path, flags: list[str], device: str = "cpu", dtype: str = "float32"
) -> ServerProcess:
    """Starts `alchemist serve` (fp32, CPU unless told) on a free port; ``wait_ready`` waits for it."""
    port = _free_port()
    log_path = log_dir / f"{name}.log"
    cmd = [sys.executable, "-m", "alchemist.cli", "serve", "--dtype", dtype, "--device", device]
    cmd += ["--port", str(port), "--served-model-name", MODEL_NAME, "--data-dir", str(data_dir), *flags]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    repo_root = Path(__file__).resolve().parents[2]
    with open(log_path, "ab") as log:  # a restarted server appends to its log
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=repo_root, env=env)
    return ServerProcess(f"http://127.0.0.1:{port}", process, log_path, data_dir)


def write_keys(path: Path, users: tuple[str, ...] = ("alice", "bob"), admins: tuple[str, ...] = ("ops",)) -> dict:
    """A keys file (``alchemist keys add``'s format) with these user and admin keys; returns name -> key."""
    from alchemist.server.auth import add_key

    return {name: add_key(path, name, admin=name in admins) for name in (*users, *admins)}


def wait_ready(server: ServerProcess) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"server exited with {server.process.returncode}:\n{server.log_path.read_text()}")
        try:
            if http_calls.get(server.base_url + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"server not ready after {STARTUP_TIMEOUT_S} s:\n{server.log_path.read_text()}")


@pytest.fixture(scope="session")
def _servers(tmp_path_factory: pytest.TempPathFactory):
    log_dir = tmp_path_factory.mktemp("server-logs")
    servers = {name: _launch(name, log_dir) for name in SERVER_FLAGS}
    try:
        for server in servers.values():
            wait_ready(server)
        yield servers
    finally:
        for server in servers.values():
            server.process.terminate()
        for server in servers.values():
            try:
                server.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                server.process.kill()


@pytest.fixture(scope="session")
def server(_servers) -> ServerProcess:
    return _servers["main"]


@pytest.fixture(scope="session")
def small_server(_servers) -> ServerProcess:
    return _servers["small"]


@pytest.fixture(scope="session")
def client(server: ServerProcess) -> openai.OpenAI:
    return server.client()


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_pretrained(hf_dir_for(None))
