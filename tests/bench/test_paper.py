"""`alchemist bench paper` end to end on a tiny random model with the default model's tokenizer (two prompt
buckets, a one-point budget grid, four servers at three rates of four requests each): every claim's rows present
and sane, the rows file and one valid PNG per claim written. Speed is not asserted."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from alchemist.bench.paper_serving import RUNS
from tests.tiny_models import make_tiny_chat_dir

pytestmark = pytest.mark.slow  # scheduled first (tests/conftest.py)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
LATENCIES = ("ttft", "tpot", "itl")
FLAGS = [
    *("--buckets", "0", "128", "256", "--sharegpt-samples", "60", "--response-tokens", "16", "--repeats", "1"),
    *("--budget-mib", "4096", "--budget-grid", "64"),
    *("--requests-per-rate", "4", "--capacity-requests", "4", "--feedback-fraction", "0.5"),
    *("--max-prompt-tokens", "128", "--max-tokens", "8", "--drain-s", "120"),
    *("--backlog-interval-s", "0.5", "--served-interval-s", "0.2"),
    # the servers: bench online's test settings (tests/bench/test_online.py says why each)
    *("--max-num-seqs", "4", "--record-budget-mb", "256", "--train-batch-size", "2", "--train-max-wait-s", "0.2"),
    *("--train-epochs", "1", "--train-protect-energy", "0", "--train-rehearse-corrections", "0", "--train-no-gate"),
    # and no well-known facts as anchors: making theirs was three quarters of a tiny step's time (8.7 s of training
    # for two corrections with them, 2.3 s without, on a busy 2-core Xeon)
    *("--train-anchor-known-facts", "0"),
    "--enforce-eager",
]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[list[dict], object]:
    root = tmp_path_factory.mktemp("paper")
    model = make_tiny_chat_dir(root)
    out = root / "out"
    cmd = [sys.executable, "-m", "alchemist.cli", "bench", "paper", "--model", str(model), "--json", "--out", str(out)]
    done = subprocess.run([*cmd, *FLAGS], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-6000:]
    return [json.loads(line) for line in done.stdout.splitlines()], out


def of(rows: list[dict], claim: str) -> list[dict]:
    return [r for r in rows if r["claim"] == claim]


def test_every_row_has_a_claim_and_the_file_holds_them(run):
    rows, out = run
    assert {r["claim"] for r in rows} == {"throughput", "memory", "budget", "serving"}
    assert [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()] == rows
    assert "bench paper" in (out / "note.txt").read_text()


def test_throughput_rows_replay_skips_the_prompt_forward(run):
    rows = of(run[0], "throughput")
    assert [r["bucket"] for r in rows] == ["0-128", "128-256"]
    for r in rows:
        lo, hi = map(int, r["bucket"].split("-"))
        assert lo < r["P"] <= hi and 1 <= r["R"] <= 16 and r["in_bucket"] >= 1
        for mode in ("replay", "recompute", "peft"):
            assert math.isfinite(r[f"{mode}_s"]) and r[f"{mode}_s"] > 0, (r, mode)
            assert r[f"{mode}_tok_s"] == pytest.approx(r["R"] / r[f"{mode}_s"])
        # the replay step went through the trainer's replay path every time (warm-up and timed): no prompt forward
        assert r["replayed"] == 2 and r["replay_recomputed"] == 0
        assert r["replay_vs_recompute"] == pytest.approx(r["recompute_s"] / r["replay_s"])
        assert r["paper"] == 1.72 and r["met"] == (r["replay_vs_recompute"] >= 1.72)


def test_memory_rows(run):
    rows = of(run[0], "memory")
    assert [r["bucket"] for r in rows] == ["0-128", "128-256"]
    for r in rows:
        assert r["replay_mib"] > 0 and r["recompute_mib"] > 0 and r["peft_mib"] > 0
        assert r["replay_vs_recompute_pct"] == pytest.approx(100 * (r["replay_mib"] / r["recompute_mib"] - 1))


def test_budget_rows(run):
    recompute, replay = of(run[0], "budget")
    assert (recompute["mode"], replay["mode"]) == ("recompute", "replay_disk")
    for r in (recompute, replay):  # 4 GiB holds the whole one-point grid: 64 prompt tokens + 128
        assert (r["max_P"], r["tokens"], r["budget_mib"]) == (64, 192, 4096) and 0 < r["peak_mib"] <= 4096
    assert replay["tokens_vs_recompute"] == 1.0 and replay["met"] is False and recompute["met"] is None


def test_serving_rows(run):
    rows = of(run[0], "serving")
    assert [r["run"] for r in rows] == [name for name in RUNS for _ in range(3)]
    rates = [r["rate"] for r in rows[:3]]
    assert rates == sorted(rates) and rates[0] > 0
    for r in rows:
        assert r["rate"] == rates[rows.index(r) % 3]  # every run at the same three rates
        assert (r["requests"], r["failed"], r["feedback"]) == (4, 0, 2), r
        for metric in LATENCIES:
            p50, p99 = r[f"{metric}_p50_ms"], r[f"{metric}_p99_ms"]
            assert 0 < p50 <= p99, (r["run"], metric)
        recording, training = RUNS[r["run"]][:2]
        assert (r["recording"], r["training"]) == (recording, training)
        if training == "on":  # each rate drained: both corrections trained and served, their times measured
            assert r["drained"] is True and r["backlog_end"] == 0 and r["unserved"] == 0
            assert len(r["served_s"]) == 2 and all(t >= 0 for t in r["served_s"])
            assert 0 <= r["served_p50_s"] <= r["served_max_s"] == max(r["served_s"])
            assert r["replayed" if recording == "on" else "recomputed"] >= 2
            assert r["recomputed" if recording == "on" else "replayed"] == 0
        else:
            assert r["served_s"] is None and r["steps"] is None and r["slices_load"] == 0


def test_one_png_per_claim(run):
    out = run[1]
    for claim in ("throughput", "memory", "budget", "serving"):
        data = (out / f"{claim}.png").read_bytes()
        assert len(data) > len(PNG_SIGNATURE) and data.startswith(PNG_SIGNATURE), claim
