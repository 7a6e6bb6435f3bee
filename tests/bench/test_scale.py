"""`alchemist bench scale` end to end on a tiny workload (4 short requests, 8 tokens each, feedback on 2): one
server, then a front with two replicas on the test run's Ray cluster, each with a fresh database of the run's
PostgreSQL server; every row's fields present and sane. Speed is not asserted."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # scheduled first (tests/conftest.py)

CMD = [sys.executable, "-m", "alchemist.cli", "bench", "scale", "--json", "--num-requests", "4", "--request-rate", "8"]
CMD += ["--max-prompt-tokens", "96", "--max-tokens", "8", "--feedback", "correction", "--feedback-fraction", "0.5"]
CMD += ["--max-num-seqs", "4", "--record-budget-mb", "256", "--train-batch-size", "2", "--train-max-wait-s", "0.2"]
# The rows' plumbing, as tests/bench/test_online.py's: one step a batch, no protected directions, no rehearsal, no gate,
# eager decode.
CMD += ["--train-epochs", "1", "--train-protect-energy", "0", "--train-rehearse-corrections", "0", "--train-no-gate"]
CMD += ["--enforce-eager"]
CMD += ["--drain-s", "120"]


def test_bench_scale_tiny(postgres_server, ray_address):
    # the run's PostgreSQL server (a fresh database per replica count) and Ray cluster
    cmd = [*CMD, "--feedback-db", postgres_server.url(), "--ray-address", ray_address]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr
    rows = {r["replicas"]: r for r in map(json.loads, done.stdout.splitlines())}
    assert list(rows) == [1, 2]
    for n, r in rows.items():
        assert (r["requests"], r["failed"], r["feedback"], r["unsettled"]) == (4, 0, 2, 0), r
        for field in ("output_tok_s", "ttft_p50_ms", "tpot_p50_ms", "samples_s_per_replica"):
            assert r[field] is not None and math.isfinite(r[field]) and r[field] > 0, (n, field)
        assert r["steps"] >= 1 and r["samples_per_replica"] * n >= 2
        assert len(r["versions"]) == 1 and r["versions"][0] >= 1  # every replica serves the one trained version
        assert r["feedback_affinity"] == 1.0  # every feedback to the replica that served it (all alive)
    assert rows[1]["allreduce_share"] == rows[1]["sync_share"] == 0
    assert 0 < rows[2]["allreduce_share"] < 1 and 0 < rows[2]["sync_share"] < 1
    assert rows[2]["allreduce_share"] + rows[2]["sync_share"] < 1
    assert rows[1]["cores_each"] == rows[2]["cores_each"] == 1  # on 2 cores: one replica of one, then two
