"""The evaluation gate: a new adapter version serves only if it stays within bounds on three fixed measures.

    gate = EvaluationGate(model, tokenizer, GateConfig(), group_size=4)
    before = yield from gate.taught_slices(adapter, facts)       # before the batch's first update: the serving state
    ...                                                          # the batch trains the adapter
    evaluation = yield from gate.evaluate_slices(adapter, facts, before)
    evaluation.promoted, evaluation.reason, evaluation.as_dict()

The measures, each against a reference computed without training:

- held-out perplexity: the perplexity of eight ShareGPT replies nobody here trains on (``heldout_sharegpt.json``:
  first turns of ``sample_requests(40, seed=5, mode="first_turn", max_prompt_tokens=80, max_reply_tokens=80)``
  with replies of 24+ tokens, none of the e2e test's held-out set) may rise at most ``heldout_max_rise`` over the
  base model's: the broad damage a batch does. Each reply token but the last is scored given that the reply goes
  on (its probability over 1 - p(end of turn)): a preference for shorter answers (thumbs, pairs) moves where
  replies stop, which is what people asked for, not what they say (docs/benchmarks.md, "Thumbs and pairs");
- canaries: well-known facts the base model answers right. Each is a question, the start of its answer and the
  answer's words ("What is the capital of France?", "The capital of France is", " Paris"); the log-probability of
  the answer's words after the start, under the base model, may drop at most ``canary_max_drop`` nats, and where
  the base model gives the answer's first token confidently (``CONFIDENT_NATS`` likelier than any other), it must
  stay the greedy choice (a version part-way to "Berlin" lost France's answer only 1.9 nats, yet said Berlin:
  docs/benchmarks.md, "The evaluation gate").
  Not greedy text: any training changes the greedy text of long answers (the lead measured most of them flipped),
  while the answer's log-probability, and its first token, move only when the fact itself is taught otherwise;
- facts taught earlier: the corrections already trained (the most recent ``taught_samples``); the loss (mean NLL
  per token) of each may rise at most ``taught_max_rise`` over the serving version's (measured at the start of the
  batch), so a batch cannot quietly unteach what people corrected before.

Cost: forwards without gradient of about 1,000 tokens (held-out 8 x ~55, canaries 16 x ~30, taught facts up to 16
x ~40, the latter twice), in slices of one layer of ``group_size`` sequences each (``sequence_logps_slices``), so
serving waits for one slice at most. The base model's side is computed once, and kept in the model cache
($ALCHEMIST_CACHE, else ~/.cache/alchemist) under a key of all it depends on, so that a server's later starts, and
other servers of the same model, read it instead of computing it at each start of a server that trains
(docs/benchmarks.md, "The suite on two workers").
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Generator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch

from alchemist.config.training import GateConfig
from alchemist.model.digest import weights_digest
from alchemist.model.gguf import default_cache_dir
from alchemist.model.llama import Adapter, Llama
from alchemist.model.tokenizer import Tokenizer
from alchemist.training.losses import first_token_margin, sequence_logp
from alchemist.training.recompute import response_values_slices, sequence_logps_slices

HELDOUT_FILE = Path(__file__).with_name("heldout_sharegpt.json")
FORMAT = 1  # part of the base values' cache key: a change to how they are computed bumps it
logger = logging.getLogger(__name__)
T = TypeVar("T")
# A canary answer's first token this many nats likelier than any other under the base model (20 times) must stay the
# greedy choice: six of the twelve, 3.3-6.4 nats; France's (4.7) flipped to Berlin 1.7-1.9 nats into a falsehood, the
# ocean's (0.9) under thumbs for shorter answers 1.5 nats down (docs/benchmarks.md, "The evaluation gate").
CONFIDENT_NATS = 3.0
Values = tuple[float, list[float], list[float]]  # held-out NLL per token; per canary its answer's logp, its margin

# (question, the answer's start, the answer's words): facts SmolLM2-135M-Instruct gives the answer to with
# probability 0.3 or more after the start (tests/training/test_evaluation.py checks it).
CANARIES = (
    ("What is the capital of France?", "The capital of France is", " Paris"),
    ("What is the capital of Japan?", "The capital of Japan is", " Tokyo"),
    ("What is the capital of Germany?", "The capital of Germany is", " Berlin"),
    ("What is the capital of Spain?", "The capital of Spain is", " Madrid"),
    ("What is the capital of the United Kingdom?", "The capital of the United Kingdom is", " London"),
    ("What is the largest planet in our solar system?", "The largest planet in our solar system is", " Jupiter"),
    ("How many legs does a spider have?", "A spider has", " eight"),
    ("Who wrote Romeo and Juliet?", "Romeo and Juliet was written by", " William Shakespeare"),
    ("What is the chemical formula of water?", "The chemical formula of water is", " H2O"),
    ("What is the largest ocean on Earth?", "The largest ocean on Earth is the", " Pacific Ocean"),
    ("What is the capital of Italy?", "The capital of Italy is", " Rome"),
    ("What is the tallest mountain in the world?", "The tallest mountain in the world is", " Mount Everest"),
)


@dataclass
class Evaluation:
    promoted: bool
    reason: str | None  # why not promoted
    heldout_ppl_rise: float
    canary_drops: dict[str, float]  # question -> nats lost against the base model (negative: gained)
    taught_rises: list[float]  # per fact taught earlier: nats per token lost against the serving version
    canary_lost: list[str] = field(default_factory=list)  # questions whose confident answer it no longer gives
    seconds: float = 0.0  # the evaluation's own time (its slices; the start-of-batch part included)
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        worst = max(self.canary_drops, key=self.canary_drops.get) if self.canary_drops else None
        return {
            "promoted": self.promoted,
            "reason": self.reason,
            "heldout_ppl_rise": round(self.heldout_ppl_rise, 5),
            "canary_worst": None if worst is None else {"question": worst, "drop": round(self.canary_drops[worst], 4)},
            "canary_mean_drop": round(sum(self.canary_drops.values()) / max(len(self.canary_drops), 1), 4),
            "canary_drops": {question: round(drop, 3) for question, drop in self.canary_drops.items()},
            "canary_lost": self.canary_lost,
            "taught_checked": len(self.taught_rises),
            "taught_worst_rise": round(max(self.taught_rises), 4) if self.taught_rises else None,
            "seconds": round(self.seconds, 3),
            **self.extra,
        }


Pair = tuple[list[int], list[int]]  # (prompt ids, response ids)


class EvaluationGate:
    def __init__(self, model: Llama, tokenizer: Tokenizer, bounds: GateConfig, group_size: int = 4,
                 reference: Adapter | None = None, cache_dir: Path | None = None) -> None:  # fmt: skip
        """``reference``: what a candidate is held to, over the base model (None: the base model alone; a named
        adapter as loaded, whose own difference from the base model is no regression of its trainer's).
        ``cache_dir``: where the base model's values are kept between processes (None: the model cache); a
        reference adapter's are computed in each process."""
        self.model = model
        self.reference = reference
        self.bounds = bounds
        self.group_size = group_size
        chats = json.loads(HELDOUT_FILE.read_text())
        self.heldout = [(tokenizer.user_prompt(c["user"]),
                         tokenizer.encode_reply(c["assistant"])) for c in chats]  # fmt: skip
        self.end_of_turn = tokenizer.end_of_turn_token_id  # the held-out replies' tokens are scored as going on
        self.canaries = [(question, answer, canary_pair(tokenizer, question, start, answer))
                         for question, start, answer in CANARIES]  # fmt: skip
        self._base: Values | None = None
        self.cache_dir = cache_dir
        self.seconds = 0.0  # time in this gate's slices so far (all evaluations)

    def taught_slices(self, adapter: Adapter | None, facts: list[Pair]) -> Generator[None, None, list[float]]:
        """The mean NLL per token of each fact under ``adapter``."""
        logps = yield from self._timed_slices(sequence_logps_slices(self.model, adapter, facts, self.group_size))
        return [-logp / len(response) for logp, (_, response) in zip(logps, facts, strict=True)]

    def evaluate_slices(
        self, adapter: Adapter, facts: list[Pair], taught_before: list[float]
    ) -> Generator[None, None, Evaluation]:
        """The candidate ``adapter`` against the bounds; ``taught_before``: ``taught_slices`` of the serving state."""
        t0 = self.seconds
        base_nll, base_canaries, base_margins = yield from self._base_values_slices()
        nll, canaries, margins = yield from self._values_slices(adapter)
        taught = yield from self.taught_slices(adapter, facts)
        rise = _exp(nll - base_nll) - 1.0
        drops = {q: before - after
                 for (q, _, _), before, after in zip(self.canaries, base_canaries, canaries, strict=True)}  # fmt: skip
        rises = [after - before for before, after in zip(taught_before, taught, strict=True)]
        lost = [(q, answer) for (q, answer, _), before, after in zip(self.canaries, base_margins, margins, strict=True)
                if before >= CONFIDENT_NATS and after <= 0]  # fmt: skip
        reasons = []
        b = self.bounds
        if rise > b.heldout_max_rise:
            reasons.append(f"held-out perplexity rose {rise:.1%} (bound {b.heldout_max_rise:.0%})")
        for question, drop in drops.items():
            if drop > b.canary_max_drop:
                reasons.append(f"canary {question!r}: its answer lost {drop:.2f} nats (bound {b.canary_max_drop:g})")
        for question, answer in lost:
            if (drop := drops[question]) <= b.canary_max_drop:  # said once per canary
                reasons.append(f"canary {question!r}: the model no longer answers {answer!r} (lost {drop:.2f} nats)")
        mean_drop = sum(drops.values()) / len(drops)
        if mean_drop > b.canary_max_mean_drop:
            bound = b.canary_max_mean_drop
            reasons.append(f"the canaries' answers lost {mean_drop:.2f} nats on average (bound {bound:g})")
        if rises and max(rises) > b.taught_max_rise:
            worse = sum(r > b.taught_max_rise for r in rises)
            reasons.append(f"{worse} fact(s) taught earlier lost up to {max(rises):.2f} nats per token "
                           f"(bound {b.taught_max_rise:g})")  # fmt: skip
        reason = "; ".join(reasons) or None
        return Evaluation(reason is None, reason, rise, drops, rises, [q for q, _ in lost], self.seconds - t0)

    def _base_values_slices(self) -> Generator[None, None, Values]:
        if self._base is None:
            path = self._base_path() if self.reference is None else None
            self._base = _read_values(path) if path is not None else None
            if self._base is None:
                self._base = yield from self._values_slices(self.reference)
                if path is not None:
                    _write_values(path, self._base)
        return self._base

    def _base_path(self) -> Path:
        """The base values' file, named by a digest of what they depend on: the model's weights and dtype, the
        held-out replies and canaries as token ids, the group size (it batches the forwards), and FORMAT."""
        digest = hashlib.sha256(f"{FORMAT}|{weights_digest(self.model)}|{self.group_size}".encode())
        digest.update(json.dumps([self.heldout, self.end_of_turn, [pair for _, _, pair in self.canaries]]).encode())
        return (self.cache_dir or default_cache_dir()) / f"gate-base-{digest.hexdigest()[:32]}.json"

    def _values_slices(self, adapter: Adapter | None) -> Generator[None, None, Values]:
        """The held-out NLL per token; per canary its answer's log-probability and its first token's margin over
        the likeliest other after its start (above 0: greedy decoding says it)."""
        heldout = sequence_logps_slices(self.model, adapter, self.heldout, self.group_size, self.end_of_turn)
        logps = yield from self._timed_slices(heldout)
        nll = -sum(logps) / sum(len(response) for _, response in self.heldout)
        model = self.model
        canaries = yield from self._timed_slices(response_values_slices(
            model, adapter, [pair for _, _, pair in self.canaries], lambda rows, response: torch.stack(
                [sequence_logp(model, rows, response), first_token_margin(model, rows, response)]), self.group_size))
        return nll, [logp for logp, _ in canaries], [margin for _, margin in canaries]

    def _timed_slices(self, slices: Generator[None, None, T]) -> Generator[None, None, T]:
        """``slices``, its own time (not the serving steps between its slices) added to ``seconds``."""
        while True:
            t0 = time.perf_counter()
            try:
                next(slices)
            except StopIteration as done:
                self.seconds += time.perf_counter() - t0
                return done.value
            self.seconds += time.perf_counter() - t0
            yield


def _read_values(path: Path) -> Values | None:
    """The base values an earlier process left at ``path``; None where there are none (or they are unreadable)."""
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        return float(data["nll"]), [float(x) for x in data["canaries"]], [float(x) for x in data["margins"]]
    except (OSError, ValueError, KeyError, TypeError) as e:  # a torn or foreign file: computed again, replaced
        logger.warning("evaluation gate: %s unreadable (%s); computing the base values again", path, e)
        return None


def _write_values(path: Path, values: Values) -> None:
    nll, canaries, margins = values
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
        partial.write_text(json.dumps({"nll": nll, "canaries": canaries, "margins": margins}))
        os.replace(partial, path)  # whole or absent: a concurrent reader never sees half a file
    except OSError as e:  # a read-only home: computed in every process, as before
        logger.warning("evaluation gate: base values not cached (%s)", e)


def canary_pair(tokenizer: Tokenizer, question: str, start: str, answer: str) -> Pair:
    """(the question's prompt and the answer's start, the answer's words): the start is tokenized with the answer,
    so the answer's tokens are the ones the model would produce after it."""
    prompt = tokenizer.user_prompt(question)
    whole, lead = tokenizer.encode(start + answer), tokenizer.encode(start)
    if whole[: len(lead)] != lead:  # a tokenizer that merges across the boundary: the answer on its own
        return prompt + lead, tokenizer.encode(answer)
    return prompt + lead, whole[len(lead) :]


def _exp(x: float) -> float:
    import math

    return math.exp(min(x, 50.0))
