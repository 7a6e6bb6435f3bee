"""The poisoning guard on a real server and the real model: a correction of random tokens (its loss far above
the running level of sensible corrections) is held in quarantine instead of trained, the rest of its batch trains,
an admin sees it (GET /v1/quarantine) and releases it, and it trains next."""

from __future__ import annotations

import random
import time

import httpx
import pytest

from alchemist.bench import http_calls
from tests.server.conftest import MODEL_NAME, ServerProcess, launch_server, wait_ready, write_keys

pytestmark = pytest.mark.slow  # scheduled first (tests/conftest.py)

# The guard screens a batch's first step; the released garbage, never learned, trains every one of --train-epochs
# steps, which the default's 16 made half the test (docs/benchmarks.md, "The suite on two workers").
FLAGS = [
    *("--max-num-seqs", "4", "--max-model-len", "256", "--train-batch-size", "4", "--train-max-wait-s", "5"),
    *("--train-loss-spike-factor", "3", "--train-loss-spike-warmup", "4", "--train-anchor-weight", "0"),
    *("--train-epochs", "8"),
]
SENSIBLE = [
    ("What is two plus two?", "Two plus two is four."),
    ("Name a primary color.", "Red is a primary color."),
    ("What is the capital of Italy?", "The capital of Italy is Rome."),
    ("What do bees make?", "Bees make honey."),
    ("How many days are in a week?", "A week has seven days."),
    ("What is frozen water called?", "Frozen water is called ice."),
    ("Which animal barks?", "Dogs bark."),
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("poisoning")
    keys = write_keys(root / "keys.toml")
    flags = [*FLAGS, "--api-keys-file", str(root / "keys.toml")]
    server = launch_server("poisoning", root, root / "data", flags, dtype="auto")  # the default dtype: bf16 where fast
    server.api_key = keys["ops"]
    try:
        wait_ready(server)
        yield server, keys
    finally:
        server.process.terminate()
        server.process.wait(timeout=30)


def correct(server: ServerProcess, corrections: list[tuple[str, str, str]]) -> list[int]:
    """Asks each (key, question, correction)'s question, then sends the corrections in a row (one batch)."""
    replies = []
    for key, question, _ in corrections:
        reply = server.client(api_key=key).chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": question}], max_tokens=8, temperature=0.0
        )
        replies.append(reply.id)
    seqs = []
    for (key, _, correction), reply_id in zip(corrections, replies, strict=True):
        headers = {"Authorization": f"Bearer {key}"}
        body = {"response_id": reply_id, "correction": correction}
        response = http_calls.post(server.base_url + "/v1/feedback", json=body, headers=headers, timeout=60)
        assert response.status_code == 200, response.text
        seqs.append(int(response.json()["id"].removeprefix("fb-")))
    return seqs


def wait_for(server: ServerProcess, predicate, timeout_s: float = 300.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        adapters = http_calls.get(server.base_url + "/v1/adapters", headers=server.headers, timeout=30).json()
        if predicate(adapters):
            return adapters
        assert time.monotonic() < deadline, adapters
        time.sleep(0.5)


def trained_seqs(adapters: dict) -> set[int]:
    return {seq for v in adapters["data"] for seq in v["metrics"].get("seqs", [])}


def quarantine(server: ServerProcess, key: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else server.headers
    return http_calls.get(server.base_url + "/v1/quarantine", headers=headers, timeout=30)


def test_a_garbage_correction_is_quarantined_and_releasable(trained):
    server, keys = trained
    warmup = correct(server, [(keys["alice"], q, c) for q, c in SENSIBLE[:4]])
    wait_for(server, lambda a: set(warmup) <= trained_seqs(a))

    rng = random.Random(0)
    garbage = "".join(rng.choice("qzxjkvbwy#%&0123456789") for _ in range(80))
    *good, poison = correct(server, [*[(keys["alice"], q, c) for q, c in SENSIBLE[4:]], (keys["bob"], "Hi.", garbage)])
    adapters = wait_for(server, lambda a: set(good) <= trained_seqs(a))
    assert poison not in trained_seqs(adapters), "the batch trained without it"
    [held] = quarantine(server).json()["data"]
    assert held["seq"] == poison and not held["released"] and "running level" in held["reason"]
    assert quarantine(server, keys["alice"]).status_code == 403  # an admin's view only

    release = http_calls.post(server.base_url + "/v1/quarantine/release", json={"seqs": [poison]},
                                   headers=server.headers, timeout=30)  # fmt: skip
    assert release.status_code == 200 and release.json()["data"][0]["released"]
    wait_for(server, lambda a: poison in trained_seqs(a))
    assert quarantine(server).json()["data"] == []
