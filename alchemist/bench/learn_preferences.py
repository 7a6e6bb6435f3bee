"""`alchemist bench learn --parts thumbs pairs`: does a preference people show only with thumbs (KTO) or with
preference pairs (DPO) move the served model?

The preference shown: shorter answers (``--prefer longer``, the control: longer ones). Before training and after
each round, the greedy answers (``--preference-tokens``) to ``--held-out`` ShareGPT questions nobody gives feedback
on; the median of their lengths is what must fall (the issue's goal: by at least 30%). Each of
``--preference-rounds`` rounds samples answers (temperature 1, recorded) to ``--preference-prompts`` new ShareGPT
questions with the adapter served now, gives the feedback as POST /v1/feedback logs it, and trains until nothing
is queued:

- ``thumbs``: one answer per question; thumbs-up (rating 1: KTO desirable) for those shorter than the round's
  median length, thumbs-down (rating -1: KTO undesirable) for the others (longer: up for those longer than the
  median, down for the others);
- ``pairs``: two answers per question, the shorter (longer) preferred (DPO; equal lengths give no pair).

Every served answer, the held-out ones included, is offered to the trainer's anchors as the server offers every
finished completion (those with feedback drop out). A row per round: entries, the sampled answers' median length,
what training did (``TrainReport``), the held-out median and its fall from round 0, and the held-out margin.

The held-out margin (``HeldOutMargins``) is the preference's implicit reward on held-out pairs, as TRL's DPO and
KTO trainers report it (``rewards/margins``, ``rewards/accuracies``): before training, ``MARGIN_SAMPLES`` answers of
the base model are sampled to each held-out question (of two, both are mostly cut at the limit), and the shortest
and the longest of different lengths make a pair: the preferred one (the shorter) and the other (not offered to the
anchors: a measurement, not traffic). After each round, r(y) = log p_served(y | x) - log p_base(y | x) for both,
and the margin is r(preferred) - r(other): its mean (nats) and the share of pairs where it is positive. It moves
with every promoted version, where the median, a count of greedy answers cut at the limit, moves only once a
preference has tipped most of them (docs/benchmarks.md, "Thumbs and pairs"). ``--seed`` picks other questions and
samples (0: the results page's). ``--no-held-out-medians``: the held-out questions are not asked again after the
rounds (their median and fall are None; the margin is measured all the same), for the test that asserts the margin
(tests/bench/test_preferences_learned.py).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
from pathlib import Path

from alchemist.bench.learn_rig import Answer, LearnRig, TrainReport
from alchemist.bench.report import print_rows
from alchemist.bench.sharegpt import sample_requests
from alchemist.config import OnlineConfig
from alchemist.training.recompute import sequence_logps_slices
from alchemist.training.slices import run_to_end

GOAL_FALL = 0.30  # the issue's: the held-out median greedy length falls by at least this
MARGIN_SAMPLES = 4  # sampled answers to each held-out question, for the held-out margin's pair


def preferences(
    args: argparse.Namespace, config: OnlineConfig, workdir: Path, feedback: str, base: HeldOutBase | None = None
) -> tuple[list[dict], HeldOutBase]:
    """``feedback``: "thumbs" or "pairs". Rows as the module says; the last one's ``goal_fall`` says if it held.
    ``base``: what an earlier part in this process measured of the base model (None: measured here); returned for
    the next."""
    rig = LearnRig(args.model, args.dtype, args.device, config, workdir)
    held_out, training = questions(rig.tokenizer, args.held_out, args.preference_rounds * args.preference_prompts,
                                   seed=31 + args.seed)  # fmt: skip
    tokens, sign = args.preference_tokens, 1 if args.prefer == "shorter" else -1  # sign * length: less is better

    def held_out_median() -> float:
        return statistics.median(len(a.output_ids) for a in rig.ask(held_out, tokens, anchor=True))

    if base is None:
        base = HeldOutBase(rig, held_out, tokens, sign, seed=7 + 100_000 * args.seed)
    margins = base.margins_for(rig)
    before = statistics.median(len(a.output_ids) for a in base.greedy)
    rows = [{"part": feedback, "prefer": args.prefer, "round": 0, "entries": 0, "sampled_median": None,
             **TrainReport().row(),
             "held_out_median": before, "fall": 0.0, **margins.row()}]  # fmt: skip
    for round_ in range(1, args.preference_rounds + 1):
        asked = training[(round_ - 1) * args.preference_prompts : round_ * args.preference_prompts]
        seed = 1000 * round_ + 100_000 * args.seed
        sampled = rig.ask(asked, tokens, anchor=True, temperature=1.0, seed=seed)
        if feedback == "pairs":
            second = rig.ask(asked, tokens, anchor=True, temperature=1.0, seed=seed + 500)
            entries = prefer_less(rig, sampled, second, sign)
            sampled += second
        else:
            entries = thumbs_for_less(rig, sampled, sign)
        report = rig.train()
        for reason in report.reasons:
            print(f"# {feedback}, round {round_}: the evaluation gate blocked a version: {reason}", file=sys.stderr)
        median = held_out_median() if args.held_out_medians else None
        rows.append({"part": feedback, "prefer": args.prefer, "round": round_, "entries": entries,
                     "sampled_median": statistics.median(len(a.output_ids) for a in sampled), **report.row(),
                     "held_out_median": median, "fall": None if median is None else round(1 - median / before, 3),
                     **margins.row()})  # fmt: skip
        print_rows(rows[-1:], True, sys.stderr)
    if args.prefer == "shorter" and args.held_out_medians:  # the control's goal is no fall: read from its rows
        rows[-1]["goal_fall"] = rows[-1]["fall"] >= GOAL_FALL
    return rows, base


class HeldOutBase:
    """What the base model answers to the held-out questions before any training, the same for every part: its
    greedy answers (the median's round 0, and anchors) and the held-out margin's pairs with their base
    log-probabilities. Measured once per process; a later part's rig is given the greedy answers as its anchors, as
    if it had asked them first itself, and its margins are measured with its own adapter."""

    def __init__(self, rig: LearnRig, questions: list[str], tokens: int, sign: int, seed: int) -> None:
        self.greedy = rig.ask(questions, tokens, anchor=True)
        self.margins = HeldOutMargins(rig, questions, tokens, sign, seed)
        self.rig = rig

    def margins_for(self, rig: LearnRig) -> HeldOutMargins:
        if rig is not self.rig:  # the earlier part's rig (its model, engine, cache) is not kept alive
            rig.offer(self.greedy)
            self.rig, self.margins = rig, self.margins.measured_by(rig)
        return self.margins


class HeldOutMargins:
    """The preference's implicit reward on held-out pairs (the module's "held-out margin"): ``row()`` measures it
    under the adapter serving now."""

    def __init__(self, rig: LearnRig, questions: list[str], tokens: int, sign: int, seed: int) -> None:
        samples = [rig.ask(questions, tokens, temperature=1.0, seed=seed + 500 * k) for k in range(MARGIN_SAMPLES)]
        self.pairs = []
        for answers in zip(*samples, strict=True):
            ends = sorted(answers, key=lambda a: sign * len(a.output_ids))
            if len(ends[0].output_ids) != len(ends[-1].output_ids):
                self.pairs.append((ends[0], ends[-1]))
        self.rig = rig
        self.base = self._logps(None)

    def measured_by(self, rig: LearnRig) -> HeldOutMargins:
        """The same pairs and base log-probabilities, measured under ``rig``'s adapter (the model is the same)."""
        margins = copy.copy(self)
        margins.rig = rig
        return margins

    def _logps(self, adapter) -> list[float]:
        """log p(answer | question) of each pair's preferred answer, then its other's, as served to a question
        nobody corrected (the corrections' ranks do not act: ``in_scope`` False)."""
        answers = [(a.prompt_ids, a.output_ids) for pair in self.pairs for a in pair]
        return run_to_end(sequence_logps_slices(self.rig.loaded.model, adapter, answers, in_scope=False))

    def row(self) -> dict:
        """``held_out_pairs``; ``held_out_margin``: the mean of r(preferred) - r(other), nats;
        ``held_out_accuracy``: the share of pairs where it is positive. The trainer's adapter is the serving version's
        between rounds (a version the gate refused gives way to the one serving)."""
        served = self._logps(self.rig.trainer.adapter)
        rewards = [s - b for s, b in zip(served, self.base, strict=True)]
        margins = [rewards[i] - rewards[i + 1] for i in range(0, len(rewards), 2)]
        if not margins:
            return {"held_out_pairs": 0, "held_out_margin": None, "held_out_accuracy": None}
        return {"held_out_pairs": len(margins), "held_out_margin": round(statistics.fmean(margins), 3),
                "held_out_accuracy": round(sum(m > 0 for m in margins) / len(margins), 3)}  # fmt: skip


def ordered(a: Answer, b: Answer, sign: int) -> tuple[Answer, Answer]:
    """(preferred, other): the one of lower ``sign`` x length first."""
    return (a, b) if sign * len(a.output_ids) < sign * len(b.output_ids) else (b, a)


def thumbs_for_less(rig: LearnRig, answers: list[Answer], sign: int) -> int:
    """Thumbs-up for the answers whose ``sign`` x length is below the median's, thumbs-down for the others; how
    many."""
    median = statistics.median(sign * len(a.output_ids) for a in answers)
    for answer in answers:
        rig.rate(answer, 1 if sign * len(answer.output_ids) < median else -1)
    return len(answers)


def prefer_less(rig: LearnRig, first: list[Answer], second: list[Answer], sign: int) -> int:
    """Of each question's two answers, the one of lower ``sign`` x length preferred over the other (equal lengths:
    no pair); how many."""
    pairs = 0
    for a, b in zip(first, second, strict=True):
        if len(a.output_ids) != len(b.output_ids):
            rig.prefer(*ordered(a, b, sign))
            pairs += 1
    return pairs


def questions(tokenizer, held_out: int, training: int, seed: int) -> tuple[list[str], list[str]]:
    """``held_out`` ShareGPT first-turn questions (<= 96 tokens) to measure on, and ``training`` others to give
    feedback on."""
    n = held_out + training + 8
    pool = sample_requests(n, seed=seed, mode="first_turn", tokenizer=tokenizer, max_prompt_tokens=96)
    distinct = list(dict.fromkeys(s.messages[0]["content"] for s in pool))
    return distinct[:held_out], distinct[held_out : held_out + training]
