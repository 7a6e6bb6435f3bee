"""`alchemist bench online` end to end on a tiny workload (4 short requests, 8 tokens each, feedback on 2): three
real server processes of a tiny random model with the default model's tokenizer and chat template, every row's
fields present and sane, the backlog sampled over time. Speed is not asserted."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from alchemist.bench.online import TRAINING_FIELDS
from tests.tiny_models import make_tiny_chat_dir

pytestmark = pytest.mark.slow  # scheduled first (tests/conftest.py)

CMD = [sys.executable, "-m", "alchemist.cli", "bench", "online", "--json", "--num-requests", "4", "--request-rate", "8"]
CMD += ["--max-prompt-tokens", "96", "--max-tokens", "8", "--max-num-seqs", "4", "--record-budget-mb", "256"]
CMD += ["--train-batch-size", "2", "--train-max-wait-s", "0.2", "--drain-s", "120", "--backlog-interval-s", "0.5"]
# The rows' plumbing: one step a batch and no protected directions (their one-off computation, before the first
# step, took most of the 120 s drain on a busy machine); no rehearsal, so that the counts below do not depend on
# whether the two corrections came in one batch or two (the second batch would rehearse the first's: timing); no
# evaluation gate (its base model's values, once per server, are most of a tiny run's training: 153 s for the test
# with it on a Zen 4, 70 s without; tests/server/test_gate.py tests it).
CMD += ["--train-epochs", "1", "--train-protect-energy", "0", "--train-rehearse-corrections", "0", "--train-no-gate"]
# Decode eager: compiled, the first server compiled the tiny model's graphs on a fresh cache (27 s) and each warm-up
# took 3.4 s of CPU, half of a tiny server's start, for rows whose speed is not asserted (the compiled step is
# tests/engine/test_compiled_decode.py's and tests/server/test_default_serve.py's).
CMD += ["--enforce-eager"]


def test_bench_online_tiny(tmp_path):
    model = ["--model", str(make_tiny_chat_dir(tmp_path))]
    done = subprocess.run([*CMD, *model], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    runs = {r["run"]: r for r in rows if "run" in r}
    assert list(runs) == ["off", "replay", "recompute"]
    for r in runs.values():
        assert (r["requests"], r["failed"], r["feedback"]) == (4, 0, 2)
        latencies = ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "itl_p50_ms", "itl_p99_ms")
        for field in ("load_s", "req_s", "output_tok_s", *latencies):
            assert r[field] is not None and math.isfinite(r[field]) and r[field] > 0, (r["run"], field)
        assert r["ttft_p50_ms"] <= r["ttft_p99_ms"] and r["tpot_p50_ms"] <= r["tpot_p99_ms"]
        assert r["itl_p50_ms"] <= r["itl_p99_ms"]
        # /metrics' histograms over the load: every step counted, slices only where training ran
        assert r["steps_load"] >= 8 and 0 <= r["steps_over_100ms_load"] <= r["steps_load"]
        assert 0 <= r["slices_over_100ms_load"] <= r["slices_load"] and r["slice_s_load"] >= 0
    assert runs["off"]["slices_load"] == 0
    assert all(runs["off"][f] is None for f in TRAINING_FIELDS)
    for name in ("replay", "recompute"):
        r = runs[name]
        assert r["drained"] is True and r["steps"] >= 1
        assert r["train_tokens"] > 0 and r["train_s"] > 0 and r["train_tok_s"] > 0
        assert 0 <= r["train_tokens_load"] <= r["train_tokens"]
    # Both trained the same 2 corrections (their anchors, the other completions served before a step, may differ
    # with timing); replay replayed them all (fresh records), recompute none.
    feedback_tokens = {name: runs[name]["train_tokens"] - runs[name]["anchor_tokens"] for name in runs if name != "off"}
    assert feedback_tokens["replay"] == feedback_tokens["recompute"] > 0
    assert (runs["replay"]["replayed"], runs["replay"]["recomputed"], runs["replay"]["replay_hit_rate"]) == (2, 0, 1.0)
    assert (runs["recompute"]["replayed"], runs["recompute"]["recomputed"]) == (0, 2)
    ratios = {r["ratio"]: r for r in rows if "ratio" in r}
    assert set(ratios) == {
        "tpot_p99_ms replay/off",
        "tpot_p99_ms recompute/off",
        "train_tok_s replay/recompute",
        "train_tok_s_load replay/recompute",
    }
    assert ratios["train_tok_s replay/recompute"]["value"] > 0
    # The backlog over time: sampled through the load and the drain; without training the 2 corrections stay
    # queued, with it they are trained by the end.
    backlog = [r for r in rows if "backlog_of" in r]
    for name in runs:
        series = [r for r in backlog if r["backlog_of"] == name]
        assert len(series) >= 2 and series[0]["phase"] == "load" and series[-1]["phase"] == "drain", series
        assert [r["t_s"] for r in series] == sorted(r["t_s"] for r in series)
        assert all(r["queued"] == r["correction"] and r["thumbs_up"] == r["preference"] == 0 for r in series)
        assert runs[name]["backlog_max"] == max(r["queued"] for r in series) <= 2
        assert runs[name]["backlog_end"] == series[-1]["queued"]
    assert runs["off"]["backlog_end"] == 2 and runs["off"]["backlog_max"] == 2
    assert runs["replay"]["backlog_end"] == runs["recompute"]["backlog_end"] == 0
