"""`alchemist serve --replicas 2` as a user starts it: a real front process, a local Ray cluster, two replicas of the
real model, a throwaway PostgreSQL feedback log. Requests through the front reach both replicas; feedback goes to
the replica that served the response; a replica killed with SIGKILL while streaming cuts its streams with an error
event (no hang), the front keeps answering through the other, and Ray brings the killed one back."""

from __future__ import annotations

import json
import os
import signal
from concurrent.futures import ThreadPoolExecutor

import pytest

from alchemist.bench import http_calls
from alchemist.scale.replica import replica_of
from tests.scale.helpers import replicas, running_front, wait_replicas
from tests.server.conftest import MODEL_NAME, ServerProcess

pytestmark = pytest.mark.slow  # scheduled first (tests/conftest.py)

@pytest.fixture(scope="module")
def front(tmp_path_factory, postgres_server, ray_address):
    flags = ["--no-train", "--max-num-seqs", "4", "--max-model-len", "512"]
    with running_front(tmp_path_factory.mktemp("replicas"), postgres_server.fresh_database(), ray_address,
                       flags) as front:  # fmt: skip
        yield front


def chat(front: ServerProcess, question: str, max_tokens: int = 8) -> dict:
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
            "temperature": 0}  # fmt: skip
    response = http_calls.post(front.base_url + "/v1/chat/completions", json=body, headers=front.headers, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def test_requests_through_the_front_reach_both_replicas(front):
    states = replicas(front)
    assert [r["id"] for r in states] == [0, 1] and {r["state"] for r in states} == {"ready"}
    assert len({r["pid"] for r in states}) == 2 and all(r["pid"] != front.process.pid for r in states)
    questions = [f"Say the number {i}." for i in range(12)]  # distinct conversations: spread by their hash
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda q: chat(front, q), questions))
    served_by = {replica_of(a["id"]) for a in answers}
    assert served_by == {0, 1}, [a["id"] for a in answers]
    assert all(a["choices"][0]["message"]["content"] for a in answers)
    # The same conversation goes to the same replica (its prefix cache), while both are idle.
    again = chat(front, questions[0])
    assert replica_of(again["id"]) == replica_of(answers[0]["id"])
    # Everything else to one replica, the first ready: a page's views (the dashboard's series) from one replica.
    stable = 'alchemist:front_requests_total{reason="stable",replica="0"}'  # labels sorted
    before = metric(front, stable)
    for _ in range(3):
        assert http_calls.get(front.base_url + "/v1/models", headers=front.headers, timeout=10).status_code == 200
    assert metric(front, stable) == before + 3


def test_feedback_goes_to_the_replica_that_served_the_response(front):
    hits = metric(front, 'alchemist:front_feedback_total{affinity="hit"}')
    for question in ("What is the capital of France?", "Name a primary colour.", "Count to three."):
        answer = chat(front, question)
        body = {"response_id": answer["id"], "rating": 1}
        response = http_calls.post(front.base_url + "/v1/feedback", json=body, headers=front.headers, timeout=30)
        assert response.status_code == 200, response.text
    assert metric(front, 'alchemist:front_feedback_total{affinity="hit"}') == hits + 3
    # the shared log holds them all, whichever replica is asked
    listed = http_calls.get(front.base_url + "/v1/feedback", headers=front.headers, timeout=30).json()["data"]
    assert len(listed) >= 3


def test_a_killed_replica_cuts_its_streams_and_comes_back(front):
    states = replicas(front)
    victim = states[0]
    # A conversation of the victim's: its stream is cut when the victim dies.
    question = next(q for q in (f"Tell a long story about the number {i}." for i in range(100))
                    if replica_of(chat(front, q, max_tokens=1)["id"]) == victim["id"])  # fmt: skip
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": question}], "max_tokens": 400,
            "min_tokens": 400, "temperature": 0, "stream": True}  # fmt: skip
    events = []
    with http_calls.stream("POST", front.base_url + "/v1/chat/completions", json=body, headers=front.headers,
                           timeout=60) as stream:  # fmt: skip
        for line in stream.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
                if len(events) == 3:
                    os.kill(victim["pid"], signal.SIGKILL)
    assert len(events) < 400 and "error" in events[-1], events[-1]
    assert events[-1]["error"]["code"] == "replica_lost"
    # The front answers through the other replica meanwhile...
    for i in range(3):
        assert replica_of(chat(front, f"Say hello {i}.")["id"]) == states[1]["id"]
    # ...and Ray restarts the killed one, which serves again (a new process).
    back = wait_replicas(front, 2, changed_pid=victim["pid"])
    assert back[0]["pid"] != victim["pid"] and back[0]["state"] == "ready"


def metric(front: ServerProcess, name: str) -> float:
    text = http_calls.get(front.base_url + "/metrics", headers=front.headers, timeout=10).text
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0
