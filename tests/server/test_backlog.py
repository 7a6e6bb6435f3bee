"""The backlog under a burst, on a real training server (the default model): every acknowledged entry ends trained
or skipped with its reason, none is lost, corrections go first, and the backlog is visible on /metrics and in the
API while it lasts (GET /v1/feedback?state=queued)."""

from __future__ import annotations

import sqlite3
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from alchemist.bench import http_calls
from alchemist.bench.serving import stop_process
from alchemist.training.checkpoint import AdapterCheckpoints
from tests.server.conftest import MODEL_NAME, ServerProcess, launch_server, wait_ready

pytestmark = pytest.mark.slow  # scheduled first (tests/conftest.py)

NUM_CORRECTIONS, NUM_RATINGS, NUM_PAIRS = 12, 12, 4
FLAGS = [
    *("--max-num-seqs", "8", "--max-model-len", "256", "--record-policy", "requested"),
    *("--train-batch-size", "4", "--train-max-wait-s", "0.5", "--train-epochs", "1", "--keep-adapter-versions", "100"),
    # The policy under test: a rating or preference not trained within 2 s is skipped. Twelve corrections go first
    # (three batches of several seconds each on this CPU): ratings wait longer than that.
    *("--train-skip-ratings-after-s", "2"),
]


def ask(server: ServerProcess, question: str, seed: int | None = None) -> str:
    sampling = {"temperature": 0.0} if seed is None else {"temperature": 1.0, "seed": seed}
    out = server.client().chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": question}], max_tokens=8,
        extra_body={"alchemist": {"record": True}}, **sampling,
    )  # fmt: skip
    return out.id


def post(server: ServerProcess, body: dict) -> dict:
    response = http_calls.post(server.base_url + "/v1/feedback", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def queued(server: ServerProcess) -> dict:
    response = http_calls.get(server.base_url + "/v1/feedback", params={"state": "queued", "limit": 1000}, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def test_a_burst_ends_trained_or_skipped_with_reasons(tmp_path):
    data = tmp_path / "data"
    server = launch_server("burst", tmp_path, data, FLAGS, dtype="auto")  # the default dtype: bf16 where fast
    try:
        wait_ready(server)
        with ThreadPoolExecutor(8) as pool:
            fixes = list(pool.map(lambda i: ask(server, f"Fact {i}: what is the code word of vault {i}?"),
                                  range(NUM_CORRECTIONS)))  # fmt: skip
            rated = list(pool.map(lambda i: ask(server, f"Name a color, number {i}."), range(NUM_RATINGS)))
            pairs = list(pool.map(lambda i: tuple(ask(server, f"Say a word ({i}).", seed=2 * i + j) for j in (0, 1)),
                                  range(NUM_PAIRS)))  # fmt: skip
        bodies = [{"response_id": rid, "correction": f"The code word of vault {i} is tangerine-{i}."}
                  for i, rid in enumerate(fixes)]  # fmt: skip
        bodies += [{"response_id": rid, "rating": 1 if i % 2 else -1, "comment": f"c{i}"}
                   for i, rid in enumerate(rated)]  # fmt: skip
        bodies += [{"response_id": a, "preferred_over": b} for a, b in pairs]
        with ThreadPoolExecutor(8) as pool:  # the burst, every submission sent twice (a client's retry)
            acks = list(pool.map(lambda body: post(server, body), bodies + bodies))
        acked = {a["id"] for a in acks}
        assert len(acked) == len(bodies) and sum(a["created"] for a in acks) == len(bodies)

        # While it lasts: the backlog is in the API (the queued entries, the counts by class) and on /metrics.
        listing = queued(server)
        assert listing["data"] and sum(c["count"] for c in listing["backlog"].values()) > 0
        assert server.metrics()['alchemist:feedback_entries{state="queued"}'] > 0

        deadline = time.monotonic() + 600
        while (listing := queued(server))["data"]:
            assert time.monotonic() < deadline, f"backlog never drained: {listing['backlog']}"
            assert server.process.poll() is None, server.log_path.read_text()
            time.sleep(1.0)
        assert all(c["count"] == 0 for c in listing["backlog"].values())
        metrics = server.metrics()
        assert all(metrics[f'alchemist:feedback_backlog{{kind="{k}"}}'] == 0 for k in listing["backlog"])
        entries = [http_calls.get(f"{server.base_url}/v1/feedback/{i}", timeout=30).json() for i in sorted(acked)]
    finally:
        stop_process(server.process)

    with sqlite3.connect(f"file:{data / 'feedback.sqlite'}?mode=ro", uri=True) as db:
        db.row_factory = sqlite3.Row
        rows = {f"fb-{r['seq']}": dict(r) for r in db.execute("SELECT * FROM feedback")}
    assert set(rows) == acked  # every acknowledged entry is in the log, and nothing else
    trained_in = {seq: v.version for v in AdapterCheckpoints(data / "adapters", keep=100).versions()
                  for seq in v.metrics.get("seqs", [])}  # fmt: skip
    for row in rows.values():
        assert row["state"] in ("trained", "skipped"), row
        if row["state"] == "trained":
            assert row["trained_version"] == trained_in[row["seq"]] and row["skip_reason"] is None
        else:
            assert row["seq"] not in trained_in and "behind" in row["skip_reason"], row
    assert all(rows[e["id"]]["state"] == e["state"] for e in entries)  # the API says what the log says
    corrections = [r for r in rows.values() if r["correction"] is not None]
    assert len(corrections) == NUM_CORRECTIONS and all(r["state"] == "trained" for r in corrections)
    skipped = [r for r in rows.values() if r["state"] == "skipped"]
    assert skipped and all(r["correction"] is None for r in skipped)  # the policy skipped ratings, not corrections
    # Corrections first: each was trained no later than any rating or preference that was trained.
    first_other = min((r["trained_version"] for r in rows.values() if r["correction"] is None and
                       r["state"] == "trained"), default=None)  # fmt: skip
    assert first_other is None or max(r["trained_version"] for r in corrections) <= first_other
