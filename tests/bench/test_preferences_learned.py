"""Must show (issue 24): a preference people show only with thumbs (KTO), or only with preference pairs (DPO),
moves the served model. `alchemist bench learn --parts thumbs pairs` in a short form (issue 41): the server's parts
in process (the real default model in the serve dtype, its engine recording prompts, the SQLite feedback log, the
online trainer at ``OnlineConfig()`` with its evaluation gate), no training flag changed; only the workload is
smaller. The preference: shorter answers. Two rounds of 48 ShareGPT questions answered (up to 96 tokens) by sampling
with the adapter served then; thumbs-up for the answers shorter than the round's median, thumbs-down for the others
(thumbs), or the shorter of two answers to a question preferred (pairs). The median length of the greedy answers to
12 held-out questions falls by at least 30%, the benchmark's goal. The benchmark's own size (64 questions a round,
128 tokens, 16 held out) was a quarter of the suite's time (docs/benchmarks.md, "The suite's short form": its
rows, and the form's margins over the goal)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # scheduled first (tests/conftest.py)

CMD = [sys.executable, "-m", "alchemist.cli", "bench", "learn", "--json", "--parts", "thumbs", "pairs"]
QUESTIONS, TOKENS = 48, 96  # a round's questions, an answer's tokens at most
CMD += ["--preference-prompts", str(QUESTIONS), "--preference-tokens", str(TOKENS), "--held-out", "12"]


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
    assert before > TOKENS / 2  # the base model's answers run long: most are cut at the limit
    assert after <= 0.7 * before, rounds
    assert rounds[-1]["goal_fall"] is True
    trained = rounds[1:]
    assert all(r["entries"] > 0 and r["steps"] >= 1 for r in trained)
    assert sum(r["promoted"] for r in trained) >= 1  # what serves went through the evaluation gate
    if feedback == "thumbs":
        assert all(r["entries"] == QUESTIONS for r in trained)  # every answer rated, up or down
