"""`alchemist serve --replicas 2` training, end to end on the real model: a front process, a local Ray cluster, two
replicas in lockstep (one gloo group), a throwaway PostgreSQL feedback log. Invented facts answered by either replica
are corrected through the front; the replicas' data-parallel steps train both corrections into one new version that
both then serve, and each replica answers both facts, the one corrected on the other replica's answer too. A replica
killed while they train comes back at the current version, and the batch its death cut short trains again."""

from __future__ import annotations

import os
import signal
import time

import pytest

from alchemist.bench import http_calls
from alchemist.bench.facts import FACTS, is_known
from alchemist.scale.replica import replica_of
from tests.scale.helpers import replicas, running_front, wait_replicas, wait_training
from tests.server.conftest import MODEL_NAME

pytestmark = pytest.mark.slow  # scheduled first (tests/conftest.py)

TRAIN_TIMEOUT_S = 900.0
# The kill's corrections say what the model says already, so that their batch ends after a step or two: the test
# before shows that the replicas learn, this one that nothing acknowledged is lost (new facts took all 16 steps:
# docs/benchmarks.md, "The suite on two workers").
KNOWN = [("What is the capital of Japan?", "The capital of Japan is Tokyo."),
         ("What is the capital of the United Kingdom?", "The capital of the United Kingdom is London."),
         ("What is the capital of Greece?", "The capital of Greece is Athens."),
         ("What is the capital of Russia?", "The capital of Russia is Moscow.")]  # fmt: skip


@pytest.fixture(scope="module")
def front(tmp_path_factory, postgres_server, ray_address):
    flags = ["--max-num-seqs", "4", "--max-model-len", "512"]
    with running_front(tmp_path_factory.mktemp("replicas-train"), postgres_server.fresh_database(), ray_address,
                       flags, dtype="auto", training=True) as front:  # bf16 where fast: the defaults  # fmt: skip
        yield front


def ask(base_url: str, question: str) -> dict:
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": question}], "max_tokens": 24,
            "temperature": 0, "alchemist": {"record": True}}  # fmt: skip
    response = http_calls.post(base_url + "/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def test_corrections_on_either_replica_train_one_version_both_serve(front):
    # A fact whose conversation goes to each replica (the front's affinity spreads them), corrected where answered.
    taught: dict[int, tuple] = {}
    for fact in FACTS:
        answer = ask(front.base_url, fact[0])
        replica = replica_of(answer["id"])
        if replica not in taught and not is_known(answer["choices"][0]["message"]["content"], fact):
            taught[replica] = (fact, answer["id"])
        if len(taught) == 2:
            break
    assert set(taught) == {0, 1}, taught
    for fact, response_id in taught.values():
        response = http_calls.post(front.base_url + "/v1/feedback", json={"response_id": response_id,
                                   "correction": fact[1]}, timeout=30)  # fmt: skip
        assert response.status_code == 200, response.text
    # One data-parallel batch: both replicas publish the same version, and the shared log has both trained by it.
    deadline = time.monotonic() + TRAIN_TIMEOUT_S
    while time.monotonic() < deadline:
        entries = http_calls.get(front.base_url + "/v1/feedback", timeout=30).json()["data"]
        states = replicas(front)
        versions = {r["adapter_version"] for r in states}
        if all(e["state"] == "trained" for e in entries) and len(versions) == 1 and versions != {0}:
            break
        assert all(e["state"] in ("queued", "trained") for e in entries), entries
        time.sleep(1.0)
    else:
        raise AssertionError(f"not trained in {TRAIN_TIMEOUT_S} s: {entries}\n{states}\n{front.log_path.read_text()}")
    assert len({e["trained_version"] for e in entries}) == 1 and len(entries) == 2
    # Each replica, asked directly, answers both facts: the one corrected on its own answer and the other's.
    for replica in states:
        for fact, _ in taught.values():
            text = ask(replica["url"], fact[0])["choices"][0]["message"]["content"]
            assert is_known(text, fact), (replica["id"], fact, text)


def test_a_replica_killed_while_training_comes_back_at_the_current_version(front):
    """A replica killed while they train: the other serves on, and its group, broken, forms again without the dead
    one (a new generation); Ray restarts the killed one, which joins the next generation and catches up with the
    survivor's version (it restarts from its own last checkpoint). The batch the kill cut short trains again: every
    acknowledged correction ends trained once, by a version both replicas then serve."""
    victim, survivor = replicas(front)
    acknowledged = []
    for question, correction in KNOWN:
        answer = ask(front.base_url, question)
        response = http_calls.post(front.base_url + "/v1/feedback", json={"response_id": answer["id"],
                                   "correction": correction}, timeout=30)  # fmt: skip
        assert response.status_code == 200, response.text
        acknowledged.append(response.json()["id"])
    os.kill(victim["pid"], signal.SIGKILL)
    for i in range(3):  # served through the survivor meanwhile
        assert replica_of(ask(front.base_url, f"Say hello {i}.")["id"]) == survivor["id"]
    wait_replicas(front, 2, changed_pid=victim["pid"])
    wait_training(front, after_generation=survivor["generation"] + 2)  # without the dead one, then with it again
    deadline = time.monotonic() + TRAIN_TIMEOUT_S
    while time.monotonic() < deadline:
        entries = {e["id"]: e for e in http_calls.get(front.base_url + "/v1/feedback", timeout=30).json()["data"]}
        assert set(acknowledged) <= set(entries)
        assert all(entries[i]["state"] in ("queued", "trained") for i in acknowledged), entries
        states = replicas(front)
        trained = {entries[i]["trained_version"] for i in acknowledged}
        if None not in trained and len({r["adapter_version"] for r in states}) == 1:  # the restarted one caught up
            break
        time.sleep(1.0)
    else:
        raise AssertionError(f"not trained in {TRAIN_TIMEOUT_S} s: {entries}\n{states}\n{front.log_path.read_text()}")
    assert states[0]["adapter_version"] >= max(trained) and states[0]["generation"] == states[1]["generation"]
