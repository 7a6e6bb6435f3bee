"""Must show (issue 24): a preference people show only with thumbs (KTO), or only with preference pairs (DPO),
moves the served model. `alchemist bench learn --parts thumbs pairs` in a short form (issue 41): the
server's parts in process (the real default model in the serve dtype, its engine recording prompts, the SQLite
feedback log, the online trainer at ``OnlineConfig()`` with its evaluation gate), no training flag changed; only the
workload is smaller. The preference: shorter answers. Two rounds of 32 ShareGPT questions answered (up to 64 tokens)
by sampling with the adapter served then; thumbs-up for the answers shorter than the round's median, thumbs-down for
the others (thumbs), or the shorter of two answers to a question preferred (pairs).

What is asserted is the held-out margin (``alchemist.bench.learn_preferences.HeldOutMargins``, TRL's
``rewards/margins`` and ``rewards/accuracies``): on 24 questions nobody rated, the served model raised the
log-probability of the shorter of two base-model answers against the longer one's, relative to the base model, on
average and for more pairs than not. After two rounds it did in all of thirteen runs here at the defaults (both
parts, other questions, 16 or 24 held out, 64 or 96 tokens): +1.1 to +6.4 nats, 62% to 91% of the pairs; after one
round it was below zero twice. The issue's own measure, the median greedy length falling by 30%, is the benchmark's
goal (docs/benchmarks.md, "Thumbs and pairs"), not asserted here: it counts greedy answers cut at the limit and
moves only once a preference has tipped most of them, which at this size it did in three runs of those thirteen; a
test of it on 12 held-out questions passed by their luck and failed CI by chance. Nor is it measured after the rounds
(``--no-held-out-medians``: four times 24 greedy answers; docs/benchmarks.md, "The suite on two workers")."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # scheduled first (tests/conftest.py)

CMD = [sys.executable, "-m", "alchemist.cli", "bench", "learn", "--json", "--held-out", "24", "--no-held-out-medians"]
PROMPTS = 32  # a round's questions
CMD += ["--preference-tokens", "64", "--preference-prompts", str(PROMPTS)]
FEEDBACK = ("thumbs", "pairs")


@pytest.fixture(scope="module")
def parts() -> dict[str, list[dict]]:
    """Both parts in one process: the base model's held-out answers measured once (``HeldOutBase``)."""
    done = subprocess.run([*CMD, "--parts", *FEEDBACK], capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    return {feedback: [r for r in rows if r["part"] == feedback] for feedback in FEEDBACK}


@pytest.fixture(params=FEEDBACK)
def rounds(request, parts) -> tuple[str, list[dict]]:
    return request.param, parts[request.param]


def test_a_preference_shown_only_by_feedback_moves_the_served_model(rounds):
    feedback, rounds = rounds
    assert [r["round"] for r in rounds] == [0, 1, 2] and {r["part"] for r in rounds} == {feedback}
    first, last = rounds[0], rounds[-1]
    assert first["held_out_pairs"] >= 4 and first["held_out_margin"] == 0  # before training the base model serves
    assert last["held_out_margin"] > 0 and last["held_out_accuracy"] > 0.5, rounds
    trained = rounds[1:]
    assert all(r["entries"] > 0 and r["steps"] >= 1 for r in trained)
    assert sum(r["promoted"] for r in trained) >= 1  # what serves went through the evaluation gate
    if feedback == "thumbs":
        assert all(r["entries"] == PROMPTS for r in trained)  # every answer rated, up or down
    assert last["held_out_median"] is None and first["held_out_median"] > 0  # measured before the rounds only
