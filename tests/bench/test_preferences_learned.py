"""Must show (issue 24): a preference people show only with thumbs (KTO), or only with preference pairs (DPO),
moves the served model. `alchemist bench learn --parts thumbs` and `--parts pairs` in a short form (issue 41): the
server's parts in process (the real default model in the serve dtype, its engine recording prompts, the SQLite
feedback log, the online trainer at ``OnlineConfig()`` with its evaluation gate), no training flag changed; only the
workload is smaller. The preference: shorter answers. Two rounds of ShareGPT questions (48 for thumbs, 64 for pairs)
answered (up to 96 tokens) by sampling with the adapter served then; thumbs-up for the answers shorter than the
round's median, thumbs-down for the others (thumbs), or the shorter of two answers to a question preferred (pairs).
The median length of the greedy answers to 12 held-out questions falls by at least 30%, the benchmark's goal. The
benchmark's own size (64 questions a round, 128 tokens, 16 held out) was a quarter of the suite's time; pairs need
more questions than thumbs, since only answers of different lengths make a pair (docs/benchmarks.md, "The suite's
short form": its rows, and its margins over the goal)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # scheduled first (tests/conftest.py)

CMD = [sys.executable, "-m", "alchemist.cli", "bench", "learn", "--json", "--held-out", "12"]
TOKENS = 96  # an answer's tokens at most
CMD += ["--preference-tokens", str(TOKENS)]
QUESTIONS = {"thumbs": 48, "pairs": 64}  # a round's


@pytest.fixture(scope="module", params=["thumbs", "pairs"])
def rounds(request) -> tuple[str, list[dict]]:
    feedback = request.param
    cmd = [*CMD, "--parts", feedback, "--preference-prompts", str(QUESTIONS[feedback])]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr
    return feedback, [json.loads(line) for line in done.stdout.splitlines()]


def test_a_preference_shown_only_by_feedback_moves_the_served_model(rounds):
    feedback, rounds = rounds
    assert [r["round"] for r in rounds] == [0, 1, 2] and {r["part"] for r in rounds} == {feedback}
    before, after = rounds[0]["held_out_median"], rounds[-1]["held_out_median"]
    assert before > TOKENS / 2  # the base model's answers run long: most are cut at the limit
    assert after <= 0.7 * before, rounds
    assert rounds[-1]["goal_fall"] is True
    trained = rounds[1:]
    assert all(r["entries"] > 0 and r["steps"] >= 1 for r in trained)
    assert sum(r["promoted"] for r in trained) >= 1  # what serves went through the evaluation gate
    if feedback == "thumbs":
        assert all(r["entries"] == QUESTIONS["thumbs"] for r in trained)  # every answer rated, up or down
