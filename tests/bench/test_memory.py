"""`alchemist bench memory` on a tiny random model: every step goes through the trainer and replays from the tier it
claims (or raises), the budget search, shape parsing, and the command's JSON rows end to end. Speed is not
asserted."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time

import pytest
import torch

from alchemist.bench.memory import BudgetFit, largest_fitting_prompt, parse_shapes, percentile
from alchemist.bench.memory_steps import RECORD_ID, StepSet, drop_from_page_cache, read_s
from alchemist.bench.report import interleaved_medians
from alchemist.model.loader import build_model

TIMED = ("recompute", "replay_memory", "replay_disk_warm", "replay_disk_cold")


@pytest.fixture(scope="module")
def model(tiny_dirs):
    return build_model(tiny_dirs["llama-gqa-untied"], torch.float32)


def test_each_step_replays_from_the_tier_it_claims(model, tmp_path):
    steps = StepSet(model, 96, 16, TIMED, record_dir=tmp_path)
    try:
        assert steps.file is not None and steps.file.is_relative_to(tmp_path) and steps.file.stat().st_size > 0
        for name in TIMED:
            steps[name]()
            if name == "replay_disk_cold":
                drop_from_page_cache(steps.file)
            steps[name]()
        recompute, memory = steps["recompute"].trainer.stats, steps["replay_memory"].trainer.stats
        assert (recompute.replayed, recompute.recomputed) == (0, 2)
        assert (memory.replayed, memory.recomputed) == (2, 0)
        assert memory.layers_reloaded + memory.layers_recomputed == 2 * model.config.num_layers
        memory_store, disk_store = steps["replay_memory"].trainer.store, steps["replay_disk_warm"].trainer.store
        assert memory_store.tier_of(RECORD_ID) == "device" and memory_store.stats.disk_reads == 0
        assert disk_store is steps["replay_disk_cold"].trainer.store and disk_store.tier_of(RECORD_ID) == "disk"
        for name in ("replay_disk_warm", "replay_disk_cold"):
            stats = steps[name].trainer.stats
            assert (stats.replayed, stats.recomputed, stats.unreadable) == (2, 0, 0)
            assert stats.record_bytes_read > 0
        # Each replay reads every layer from the file in its forward, and again (all of it, or its input) in the walk.
        assert disk_store.stats.disk_reads == 4 * 2 * model.config.num_layers
        assert read_s(steps.file) > 0
    finally:
        steps.close()
    assert not steps.file.exists()


def test_a_replay_that_recomputes_raises(model, tmp_path):
    steps = StepSet(model, 48, 8, ["replay_disk"], record_dir=tmp_path)
    try:
        step = steps["replay_disk"]
        step.trainer.adapter.version += 1  # the record is now stale: the trainer recomputes the sample
        with pytest.raises(RuntimeError, match=r"\(replayed, recomputed\) = \(0, 1\)"):
            step()
    finally:
        steps.close()


def test_interleaved_medians_runs_before_untimed_before_every_call():
    calls = []
    medians = interleaved_medians(
        {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")},
        repeats=2,
        before={"b": lambda: (calls.append("drop"), time.sleep(0.05))},
    )
    assert calls == ["a", "drop", "b"] * 3  # warm-up round, then two timed rounds
    assert medians["b"] < 0.05  # the sleep before "b" is not in its time


def test_largest_fitting_prompt_probes_up_to_the_first_miss():
    probed = []

    def peak_mib(num_prompt: int) -> float:
        probed.append(num_prompt)
        return num_prompt / 10

    assert largest_fitting_prompt(peak_mib, [400, 100, 800, 200], 30) == BudgetFit(200, 20.0, 400, 40.0)
    assert probed == [100, 200, 400]
    assert largest_fitting_prompt(peak_mib, [100, 200], 5) == BudgetFit(None, None, 100, 10.0)
    assert largest_fitting_prompt(peak_mib, [100, 200], 1e9) == BudgetFit(200, 20.0, None, None)


def test_parse_shapes():
    lengths = [(p, r) for p, r in zip(range(10, 110, 10), range(100, 0, -10), strict=True)]
    calls = []

    def sharegpt():
        calls.append(1)
        return lengths

    shapes = parse_shapes(["1024x128", "sharegpt-p50", "sharegpt-p90"], 8192, sharegpt)
    assert [(s.num_prompt, s.num_response) for s in shapes] == [(1024, 128), (50, 50), (90, 90)]
    assert shapes[0].source == "given" and "p90" in shapes[2].source and len(calls) == 1
    assert percentile([3, 1, 2], 100) == 3 and percentile([3, 1, 2], 1) == 1
    for bad in ("8100x128", "1x5", "1024", "sharegpt-p0"):
        with pytest.raises(ValueError, match="--shapes"):
            parse_shapes([bad], 8192, sharegpt)


@pytest.fixture(scope="module")
def cli_rows(tiny_dirs) -> dict[str, list[dict]]:
    """One run of the command: one shape, and a two-point budget grid whose first point is that shape."""
    cmd = [sys.executable, "-m", "alchemist.cli", "bench", "memory", "--model", str(tiny_dirs["llama-gqa-untied"])]
    cmd += ["--shapes", "256x128", "--repeats", "1", "--budget-grid", "256", "384", "--budget-mib", "2", "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    parts: dict[str, list[dict]] = {}
    for line in done.stdout.splitlines():
        row = json.loads(line)
        parts.setdefault(row.pop("part"), []).append(row)
    return parts


def test_cli_memory_and_time_rows(cli_rows):
    assert set(cli_rows) == {"shapes", "memory", "time", "page_cache", "budget", "goals"}
    (memory,) = cli_rows["memory"]
    assert (memory["P"], memory["R"]) == (256, 128)
    assert memory["recompute_mib"] > memory["replay_disk_mib"] > 0  # the layer walk keeps the prompt rows' graph out
    assert memory["replay_disk_pct"] == pytest.approx(100 * (memory["replay_disk_mib"] / memory["recompute_mib"] - 1))
    (time_row,) = cli_rows["time"]
    for key in ("recompute_s", "replay_memory_s", "disk_warm_s", "disk_cold_s", "warm_vs_memory", "cold_vs_memory"):
        assert math.isfinite(time_row[key]) and time_row[key] > 0, key
    (cache,) = cli_rows["page_cache"]
    assert cache["file_mib"] >= memory["record_mib"] > 0 and cache["read_cold_s"] > 0 and cache["read_warm_s"] > 0


def test_cli_budget_rows(cli_rows):
    recompute, replay = cli_rows["budget"]
    assert (recompute["mode"], replay["mode"]) == ("recompute", "replay_disk")
    (memory,) = cli_rows["memory"]
    for row, peak_at_256 in ((recompute, memory["recompute_mib"]), (replay, memory["replay_disk_mib"])):
        if row["max_P"] is not None:  # what fits was measured to fit, and the next grid point was measured not to
            assert row["peak_mib"] <= 2 and row["tokens"] == row["max_P"] + 128
        if row["next_P"] is not None:
            assert row["next_peak_mib"] > 2 and row["next_P"] == (256 if row["max_P"] is None else 384)
        if 256 in (row["max_P"], row["next_P"]):  # the shape's own measurement, reused
            assert peak_at_256 in (row["peak_mib"], row["next_peak_mib"])
    expected = replay["tokens"] / recompute["tokens"] if recompute["tokens"] else None
    assert replay["tokens_vs_recompute"] == expected
    goals = {row["goal"]: row for row in cli_rows["goals"]}
    tokens_goal = goals["tokens per step under the budget, replay from disk / recompute (grid)"]
    assert tokens_goal["value"] == expected and tokens_goal["met"] == (None if expected is None else expected >= 3)
