"""The poisoning guard's parts: which losses it flags, and held entries (a state of the feedback log's entry)
across restarts."""

from __future__ import annotations

import math

from alchemist.feedback.sqlite_log import SQLiteFeedbackLog
from alchemist.training.feedback_batch import Item
from alchemist.training.quarantine import LossGuard, PoisoningGuard, Quarantine


def test_the_guard_flags_nan_inf_and_spikes_after_warmup():
    guard = LossGuard(spike_factor=5.0, warmup=3)
    assert guard.check([50.0, 2.0]) == [None, None]  # warming up: no level to compare with yet
    reasons = guard.check([float("nan"), math.inf, 2.0])
    assert reasons[0] == "loss is nan" and reasons[1] == "loss is inf" and reasons[2] is None
    level = guard.level
    reasons = guard.check([5 * level + 0.1, 2.0])
    assert reasons[0].startswith("loss") and "running level" in reasons[0] and reasons[1] is None
    assert LossGuard(spike_factor=0.0, warmup=0).check([1e9, math.nan])[0] is None  # 0: finiteness only


def test_held_entries_stay_held_across_restarts_until_released_and_trained(tmp_path):
    log = SQLiteFeedbackLog(tmp_path / "feedback.sqlite")
    entry, _ = log.append(
        response_id="r", kind="sft", rating=None, correction="x", preferred_over=None, prompt_token_ids=[1],
        response_token_ids=[2], output_token_ids=[3], rejected_token_ids=None, adapter_version=0, recorded=False,
    )  # fmt: skip
    assert Quarantine(log).hold(entry, "loss is nan", math.nan)
    log.close()
    released = []  # the trainer's queue is told to read the log again
    reopened = SQLiteFeedbackLog(tmp_path / "feedback.sqlite")  # a restart
    again = Quarantine(reopened, on_release=lambda: released.append(True))
    [held] = again.list()
    assert again.is_held(entry.seq)
    assert (held["reason"], held["loss"], held["released"]) == ("loss is nan", "nan", False)
    assert again.release([entry.seq, 999]) == [entry.seq] and released == [True]
    assert again.release([entry.seq]) == [] and released == [True]  # released already: nothing to tell
    assert not again.is_held(entry.seq) and again.list()[0]["released"]
    again.log.mark_trained([entry.seq], 2)
    assert again.list() == []


def test_levels_are_per_kind_preferences_are_checked_for_nan_only_and_released_entries_not_at_all(tmp_path):
    log = SQLiteFeedbackLog(tmp_path / "feedback.sqlite")
    ids = dict(prompt_token_ids=[1], response_token_ids=[2], output_token_ids=[3], adapter_version=0, recorded=False)
    fix, _ = log.append(response_id="c", kind="sft", correction="x", **ids)
    rated, _ = log.append(response_id="u", kind="sft", rating=1, **ids)
    pair, _ = log.append(response_id="p", kind="preference", preferred_over="q", rejected_token_ids=[4], **ids)
    guard = PoisoningGuard(spike_factor=2.0, warmup=1)
    sft, dpo = Item("sft", [1], [2], seq=0), Item("dpo", [1], [2], rejected_ids=[4], seq=0)
    guard.suspects([(fix, sft, 5.0), (rated, sft, 0.1), (pair, dpo, 0.7), (pair, dpo, 0.7)])  # the levels
    suspects = guard.suspects([(fix, sft, 9.0), (rated, sft, 0.5), (pair, dpo, 500.0), (pair, dpo, math.nan)])
    assert set(suspects) == {rated.seq, pair.seq}  # 0.5 spikes over the rated level (0.1); 9 < 2 x 5 does not
    assert suspects[pair.seq] == ("loss is nan", suspects[pair.seq][1])  # a DPO loss of 500 is not a spike
    log.mark_quarantined(rated.seq, "x", 0.5)
    log.release([rated.seq])
    assert guard.suspects([(log.get(rated.seq), sft, math.inf)]) == {}  # released: unchecked
