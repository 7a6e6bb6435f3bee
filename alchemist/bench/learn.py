"""`alchemist bench learn`: what people's corrections teach with the default settings, what it costs, how fast.

    alchemist bench learn [--parts teach forgetting throughput thumbs pairs] [--set lr=1e-3 ...] [--json]
                          [--rounds 3] [--facts 50] [--repeats 3] [--preference-prompts 64]

Parts (each one's rows carry ``part``; each builds its own parts, so they can run separately):

- ``teach``: the ten invented facts of ``alchemist.bench.facts``, asked (greedy, 24 tokens, recorded) in rounds
  beside ``--others`` ShareGPT questions nobody gives feedback on (the trainer's anchors); each round corrects the
  wrong answers and trains until nothing is queued, then asks again. A row per round: the facts known after that
  many corrections each (at most), the mini-batches trained and how many versions the evaluation gate promoted or
  blocked (and the facts not known, with their answers, on stderr). Then the held-out perplexity rise (12 ShareGPT
  replies, fp32, vs the base model) and how many of ``--unrelated`` other ShareGPT questions (each asked alone) keep
  their greedy answer (32 tokens, and its first 16);
- ``forgetting``: ``--facts`` facts made from templates (``invented_facts``), taught one after another (asked;
  corrected and trained if wrong, at most twice), all taught so far asked again after every tenth: how many of the
  first ten are still known (and of all of them);
- ``throughput``: training samples per second of SFT, KTO and DPO mini-batches, replayed from serving's records vs
  recomputed (``alchemist.bench.learn_throughput``);
- ``thumbs``, ``pairs``: a preference (shorter answers) shown only with thumbs (KTO) or preference pairs (DPO) on
  sampled answers, in rounds; the median greedy length of held-out answers before and after
  (``alchemist.bench.learn_preferences``).

The backlog under load (queued feedback by class over time) is `alchemist bench online`'s ``backlog`` rows.

Training is the server's: the model in ``--dtype``, the engine with the default record policy, the feedback log,
the ``OnlineTrainer`` with ``OnlineConfig()`` (plus ``--set`` overrides), its evaluation gate included
(``alchemist.bench.learn_rig``).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

from alchemist.bench.facts import FACTS, Fact, held_out_nll, held_out_replies, invented_facts, is_known
from alchemist.bench.learn_preferences import preferences
from alchemist.bench.learn_rig import Answer, LearnRig, TrainReport
from alchemist.bench.report import print_rows
from alchemist.bench.sharegpt import sample_requests
from alchemist.config import OnlineConfig, TrainerConfig
from alchemist.config.parse import parse_config
from alchemist.config.root import file_flags, leaves
from alchemist.config.training import FORMER_KEYS
from alchemist.model.loader import load_model

PARTS = ("teach", "forgetting", "throughput", "thumbs", "pairs")
FACT_TOKENS = 24  # an answer's length: the e2e test's
OTHER_TOKENS = 24  # the anchors' (the served traffic's) answers
UNRELATED_TOKENS = 32


def online_config(sets: list[str]) -> OnlineConfig:
    """``OnlineConfig()`` with ``--set NAME=VALUE`` overrides, the value as YAML reads it (commas making a list),
    parsed and checked by the serve parser. NAME: a setting's dotted path under OnlineConfig (``stopping.epochs``),
    a TrainerConfig field's name (``lr``), or a former flat OnlineConfig field's (``epochs``, ``gate``: FORMER_KEYS),
    so that the commands in docs/ still run."""
    paths = {path.removeprefix("online.") for path, _, _ in leaves() if path.startswith("online.")}
    trainer_fields = {f.name for f in dataclasses.fields(TrainerConfig)}
    online: dict = {}
    for s in sets:
        name, sep, value = s.partition("=")
        path = name if name in paths else f"trainer.{name}" if name in trainer_fields else FORMER_KEYS.get(name)
        if not sep or path is None:
            raise ValueError(f"--set {s!r}: expected NAME=VALUE with NAME an OnlineConfig setting (e.g. "
                             "stopping.epochs), a TrainerConfig field or a former flat name")  # fmt: skip
        *sections, leaf = path.split(".")
        holder = online
        for section in sections:
            holder = holder.setdefault(section, {})
        holder[leaf] = [yaml.safe_load(v) for v in value.split(",") if v] if "," in value else yaml.safe_load(value)
    return parse_config(file_flags({"online": online}), prog="alchemist bench learn --set").online


def sharegpt_questions(tokenizer, n: int, seed: int, exclude: set[str]) -> list[str]:
    """``n`` ShareGPT first user turns (<= 96 tokens), none of ``exclude`` nor of the held-out replies."""
    held = exclude | {s.messages[0]["content"] for s in held_out_replies(tokenizer)}
    pool = sample_requests(n + len(held), seed=seed, mode="first_turn", tokenizer=tokenizer, max_prompt_tokens=96)
    return [q for q in (s.messages[0]["content"] for s in pool) if q not in held][:n]


def known(rig: LearnRig, facts: list[Fact]) -> tuple[list[bool], list[Answer]]:
    """Each fact's question asked (greedy, as served): whether the answer holds it, and the answers."""
    answers = rig.ask([q for q, _, _ in facts], FACT_TOKENS)
    return [is_known(a.text, f) for a, f in zip(answers, facts, strict=True)], answers


# --- teach ------------------------------------------------------------------------------------------------------


def teach(args: argparse.Namespace, config: OnlineConfig, workdir: Path) -> list[dict]:
    rig = LearnRig(args.model, args.dtype, args.device, config, workdir)
    tok = rig.tokenizer
    facts = FACTS[: args.teach_facts]
    unrelated = sharegpt_questions(tok, args.unrelated, seed=23, exclude=set())
    traffic = sharegpt_questions(tok, args.rounds * args.others, seed=11, exclude=set(unrelated))
    before = ask_alone(rig, unrelated, UNRELATED_TOKENS)
    held, answers = known(rig, facts)
    rows = [{"part": "teach", "round": 0, "known": sum(held), "of": len(facts), "corrected": 0, **TrainReport().row()}]
    for round_ in range(1, args.rounds + 1):
        rig.ask(traffic[(round_ - 1) * args.others : round_ * args.others], OTHER_TOKENS, anchor=True)
        wrong = [(a, f) for a, f, ok in zip(answers, facts, held, strict=True) if not ok]
        for answer, (_, correction, _) in wrong:
            rig.correct(answer, correction)
        report = blocked_to_stderr(rig.train(), f"teach, round {round_}")
        held, answers = known(rig, facts)
        rows.append({"part": "teach", "round": round_, "known": sum(held), "of": len(facts),
                     "corrected": len(wrong), **report.row()})  # fmt: skip
        print_rows(rows[-1:], True, sys.stderr)
        for answer, (question, _, _), ok in zip(answers, facts, held, strict=True):
            if not ok:
                print(f"# round {round_}, not known: {question!r} -> {answer.text!r}", file=sys.stderr)
    after = ask_alone(rig, unrelated, UNRELATED_TOKENS)
    same = sum(a.output_ids == b.output_ids for a, b in zip(before, after, strict=True))
    same_16 = sum(a.output_ids[:16] == b.output_ids[:16] for a, b in zip(before, after, strict=True))
    rise = perplexity_rise(args, rig)
    by_two = next((r["known"] for r in rows if r["round"] == min(2, args.rounds)), 0)
    rows.append({"part": "teach_end", "perplexity_rise": round(rise, 4), "unrelated": len(unrelated),
                 "unchanged_32": same, "unchanged_16": same_16,
                 "goal_known_by_2": by_two >= 0.9 * len(facts), "goal_rise": rise < 0.05,
                 "goal_unchanged": same >= 0.8 * len(unrelated)})  # fmt: skip
    return rows


def ask_alone(rig: LearnRig, questions: list[str], max_tokens: int) -> list[Answer]:
    """Greedy answers, one question at a time, so that each decodes alone before and after the teaching: in bf16 an
    answer depends on the batches it decodes in, and the engine's scheduler, which times its steps, mixes prefills
    and decodes differently from one run to the next (tests/server/test_online.py asks the server so too). Asked all
    together, the count measured the scheduler (docs/benchmarks.md, "Learning with the defaults")."""
    return [answer for question in questions for answer in rig.ask([question], max_tokens)]


def perplexity_rise(args: argparse.Namespace, rig: LearnRig) -> float:
    """Held-out perplexity of the serving adapter over the base model's, both in fp32 (a version the gate blocked
    is not the trainer's adapter any more: it went back to the serving one)."""
    model = rig.loaded.model
    fp32 = rig.loaded if model.dtype == torch.float32 else load_model(args.model, "float32", str(model.device))
    base = held_out_nll(fp32.model, fp32.tokenizer, None).mean()
    taught = held_out_nll(fp32.model, fp32.tokenizer, rig.trainer.adapter).mean()
    return math.exp(taught - base) - 1


# --- forgetting -------------------------------------------------------------------------------------------------


def forgetting(args: argparse.Namespace, config: OnlineConfig, workdir: Path) -> list[dict]:
    rig = LearnRig(args.model, args.dtype, args.device, config, workdir)
    facts = invented_facts(args.facts)
    first = facts[:10]
    n = args.others + args.facts * args.others_per_fact
    traffic = iter(sharegpt_questions(rig.tokenizer, n, seed=13, exclude=set()))
    rig.ask([next(traffic) for _ in range(args.others)], OTHER_TOKENS, anchor=True)  # the first steps' anchors
    total, learned, corrections, rows, t0 = TrainReport(), 0, 0, [], time.perf_counter()
    for i, fact in enumerate(facts, start=1):
        rig.ask([next(traffic) for _ in range(args.others_per_fact)], OTHER_TOKENS, anchor=True)
        for attempt in range(3):  # asked; corrected if wrong, at most twice
            (ok,), (answer,) = known(rig, [fact])
            if ok or attempt == 2:
                learned += ok
                break
            rig.correct(answer, fact[1])
            corrections += 1
            _add(total, blocked_to_stderr(rig.train(), f"forgetting, fact {i}"))
        if i % 10 == 0 or i == len(facts):
            held, _ = known(rig, facts[:i])  # the first ten's and all taught so far
            rows.append({"part": "forgetting", "taught": i, "first_ten_known": sum(held[: len(first)]),
                         "of": len(first), "taught_known": sum(held), "learned_when_taught": learned,
                         "corrections": corrections, **total.row(),
                         "wall_s": round(time.perf_counter() - t0, 1)})  # fmt: skip
            print_rows(rows[-1:], True, sys.stderr)
    return rows


def blocked_to_stderr(report: TrainReport, where: str) -> TrainReport:
    for reason in report.reasons:
        print(f"# {where}: the evaluation gate blocked a version: {reason}", file=sys.stderr)
    return report


def _add(total: TrainReport, report: TrainReport) -> None:
    for f in ("batches", "promoted", "blocked", "steps", "quarantined", "train_s"):
        setattr(total, f, getattr(total, f) + getattr(report, f))
    total.reasons += report.reasons


# --- driver -----------------------------------------------------------------------------------------------------


def main(args: argparse.Namespace) -> int:
    for part in args.parts:
        if part not in PARTS:
            raise ValueError(f"--parts: unknown part {part!r}; choose from {', '.join(PARTS)}")
    if not 1 <= args.teach_facts <= len(FACTS) or min(args.rounds, args.facts, args.preference_rounds) < 1:
        raise ValueError(f"--teach-facts must be in 1..{len(FACTS)}, --rounds, --facts, --preference-rounds >= 1")
    if min(args.preference_prompts, args.held_out, args.preference_tokens) < 1:
        raise ValueError("--preference-prompts, --held-out and --preference-tokens must be >= 1")
    config = online_config(args.set)
    note = (f"# OnlineConfig() with {args.set or 'no overrides'}; dtype {args.dtype}, device {args.device}; "
            f"{os.cpu_count()} CPUs, {platform.processor() or platform.machine()}, load average at start "
            f"{os.getloadavg()[0]:.1f}")  # fmt: skip
    print(note, file=sys.stderr)
    rows, held_out_base = [], None  # thumbs and pairs measure the base model's held-out answers once
    for part in PARTS:  # this order
        if part not in args.parts:
            continue
        with tempfile.TemporaryDirectory(prefix=f"alchemist-bench-learn-{part}-") as workdir:
            if part == "teach":
                rows += teach(args, config, Path(workdir))
            elif part == "forgetting":
                rows += forgetting(args, config, Path(workdir))
            elif part == "throughput":
                from alchemist.bench.learn_throughput import throughput

                rows += throughput(args, config)
            else:
                part_rows, held_out_base = preferences(args, config, Path(workdir), part, held_out_base)
                rows += part_rows
    for part in dict.fromkeys(r["part"] for r in rows):  # a table each: their columns differ
        print_rows([r for r in rows if r["part"] == part], args.json)
        if not args.json:
            print()
    if not args.json:
        print(f"{note}, at end {os.getloadavg()[0]:.1f}")
    return 0
