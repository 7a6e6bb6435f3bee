"""Must show (issue 24): a preference people show only with thumbs (KTO), or only with preference pairs (DPO),
moves the served model. `alchemist bench learn --parts thumbs pairs` as the benchmark runs it: the server's parts
in process (the real default model in the serve dtype, its engine recording prompts, the SQLite feedback log, the
online trainer at ``OnlineConfig()`` with its evaluation gate), no flag changed. The preference: shorter answers.
Two rounds of 64 ShareGPT questions answered by sampling with the adapter served then; thumbs-up for the answers
shorter than the round's median, thumbs-down for the others (thumbs), or the shorter of two answers to a question
preferred (pairs). The median length of the greedy answers to 16 held-out questions falls by at least 30%."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # scheduled first (tests/conftest.py)

CMD = [sys.executable, "-m", "alchemist.cli", "bench", "learn", "--json", "--parts", "thumbs", "pairs"]


@pytest.fixture(scope="module")
def rows() -> dict[str, list[dict]]:
    done = subprocess.run(CMD, capture_output=True, text=True, timeout=2400)
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    return {part: [r for r in rows if r["part"] == part] for part in ("thumbs", "pairs")}


@pytest.mark.parametrize("feedback", ["thumbs", "pairs"])
def test_a_preference_shown_only_by_feedback_moves_the_served_model(rows, feedback):
    rounds = rows[feedback]
    assert [r["round"] for r in rounds] == [0, 1, 2]
    before, after = rounds[0]["held_out_median"], rounds[-1]["held_out_median"]
    assert before > 64  # the base model's answers run long: most are cut at 128 tokens
    assert after <= 0.7 * before, rounds
    assert rounds[-1]["goal_fall"] is True
    trained = rounds[1:]
    assert all(r["entries"] > 0 and r["steps"] >= 1 for r in trained)
    assert sum(r["promoted"] for r in trained) >= 1  # what serves went through the evaluation gate
    if feedback == "thumbs":
        assert all(r["entries"] == 64 for r in trained)  # every answer rated, up or down
