"""`alchemist bench learn` end to end at minimal sizes on a tiny random model with the default model's tokenizer
and chat template (its teaching is the server's trainer with the evaluation gate, whose canaries and held-out replies
are chat): every part's rows present, consistent and sane. What is learned and how fast is not asserted (the real
model learns in tests/server/test_online.py and tests/bench/test_preferences_learned.py); the invented facts are
checked exactly."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from alchemist.bench.facts import FACTS, TEMPLATES, invented_facts, is_known
from alchemist.bench.learn import online_config
from tests.tiny_models import make_tiny_chat_dir

pytestmark = pytest.mark.slow  # scheduled first (tests/conftest.py)

CMD = [sys.executable, "-m", "alchemist.cli", "bench", "learn", "--json"]
# The rows' plumbing, not the learning: one step a batch and no protected directions (whose one-off computation
# would be most of a one-fact run) keep each run short; the evaluation gate stays, its counts are checked.
QUICK = ("--set", "epochs=1", "--set", "protect_energy=0")


# The parts in one process (one start-up, one computation of the gate's base values), each part's own flags.
PARTS = ("--parts", "teach", "forgetting", "throughput", "thumbs", "--others", "2")
TEACH = ("--teach-facts", "2", "--rounds", "1", "--unrelated", "2")
FORGETTING = ("--facts", "1", "--others-per-fact", "0")
# long enough that the tiny model's times, rounded to milliseconds, still give their ratios
THROUGHPUT = ("--throughput-items", "2", "--max-prompt-tokens", "768", "--max-response-tokens", "64", "--repeats", "1")
# the held-out medians after each round, which the real model's test leaves out (--no-held-out-medians)
THUMBS = ("--preference-prompts", "4", "--preference-rounds", "1", "--preference-tokens", "8", "--held-out", "4")


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> list[dict]:
    model = ("--model", str(make_tiny_chat_dir(tmp_path_factory.mktemp("learn"))))
    done = subprocess.run([*CMD, *model, *PARTS, *TEACH, *FORGETTING, *THROUGHPUT, *THUMBS, *QUICK],
                          capture_output=True, text=True, timeout=900)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines()]


def test_teach_rows(rows):
    assert {r["part"] for r in rows} == {"teach", "teach_end", "forgetting", "throughput", "thumbs"}
    teach = [r for r in rows if r["part"] == "teach"]
    assert [r["round"] for r in teach] == [0, 1]
    assert teach[0]["known"] == 0 and teach[0]["of"] == 2  # it could not know them
    first = teach[1]
    assert first["corrected"] == 2 and 0 <= first["known"] <= 2
    assert first["batches"] >= 1 and first["promoted"] + first["blocked"] == first["batches"]
    assert first["steps"] >= first["batches"] and first["train_s"] > 0
    (end,) = [r for r in rows if r["part"] == "teach_end"]
    assert math.isfinite(end["perplexity_rise"]) and end["unrelated"] == 2
    assert 0 <= end["unchanged_16"] <= 2 and end["unchanged_32"] <= end["unchanged_16"]
    assert {end["goal_known_by_2"], end["goal_rise"], end["goal_unchanged"]} <= {True, False}


def test_forgetting_rows(rows):
    (forgetting,) = [r for r in rows if r["part"] == "forgetting"]
    assert forgetting["part"] == "forgetting"
    assert forgetting["taught"] == forgetting["of"] == 1 and 1 <= forgetting["corrections"] <= 2
    assert forgetting["taught_known"] == forgetting["first_ten_known"] <= 1  # one fact: both are it
    assert forgetting["learned_when_taught"] <= 1
    assert forgetting["batches"] == forgetting["promoted"] + forgetting["blocked"] >= 1


def test_throughput_rows(rows):
    rows = [r for r in rows if r["part"] == "throughput"]
    by = {r["objective"]: r for r in rows}
    assert list(by) == ["sft", "kto", "dpo"] and all(r["part"] == "throughput" for r in rows)
    assert [by[o]["passes"] for o in by] == [2, 2, 4]  # a DPO pair is two passes
    for r in rows:
        assert r["items"] == 2 and r["response_tokens"] <= 64 and r["prompt_tokens"] <= 768
        assert r["replay_s"] > 0 and r["recompute_s"] > 0
        # the ratios are of the unrounded times: apart by the times' rounding (to 0.001) and their own (to 0.01)
        ratio, items_s = r["recompute_s"] / r["replay_s"], 2 / r["replay_s"]
        off = 0.0005 / r["replay_s"] + 0.0005 / r["recompute_s"]  # relative, at most
        assert abs(r["ratio"] - ratio) <= 0.005 + off * ratio
        assert abs(r["replay_items_s"] - items_s) <= 0.005 + 0.0005 / r["replay_s"] * items_s
    assert by["sft"]["reference_s"] == 0 < by["kto"]["reference_s"]  # SFT needs no reference model
    assert by["kto"]["kl_s"] > 0 and by["kto"]["kl_recompute_s"] > 0 and by["dpo"]["reference_recompute_s"] > 0
    assert by["sft"]["met"] is None and {by["kto"]["met"], by["dpo"]["met"]} <= {True, False}


def test_invented_facts_are_deterministic_and_distinct():
    facts = invented_facts(50)
    assert facts == invented_facts(50) != invented_facts(50, seed=1)
    assert invented_facts(12) == facts[:12]
    keys = [key for _, _, key in facts]
    assert len(set(keys)) == 50 and not set(keys) & {key for _, _, key in FACTS}
    assert len({q for q, _, _ in facts}) == 50
    for i, (question, correction, key) in enumerate(facts):
        assert key in correction.lower() and key not in question.lower()
        assert is_known(correction, facts[i]) and question.startswith(TEMPLATES[i % len(TEMPLATES)][0][:8])


def test_set_overrides_online_config_fields_only():
    """By a TrainerConfig field's name, a former flat name (the commands in docs/), or a dotted path."""
    config = online_config(["lr=1e-3", "epochs=4", "gate=false", "anchors.weight=1.5", "trainer.group_size=2"])
    assert (config.trainer.lr, config.stopping.epochs, config.gate.enabled) == (1e-3, 4, False)
    assert (config.anchors.weight, config.trainer.group_size) == (1.5, 2)
    with pytest.raises(ValueError, match="no_such_field"):
        online_config(["no_such_field=1"])


def test_thumbs_rows(rows):
    rounds = [r for r in rows if r["part"] == "thumbs"]
    assert [r["round"] for r in rounds] == [0, 1] and rounds[1]["entries"] == 4  # every answer rated, up or down
    before, after = rounds[0]["held_out_median"], rounds[1]["held_out_median"]
    assert 1 <= before <= 8 and 1 <= after <= 8  # asked again after the round
    assert rounds[1]["fall"] == round(1 - after / before, 3) and rounds[1]["goal_fall"] == (rounds[1]["fall"] >= 0.3)
    assert rounds[1]["batches"] == rounds[1]["promoted"] + rounds[1]["blocked"] >= 1
