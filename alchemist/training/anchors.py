"""Anchors: keep the served model close to the base model on the traffic it serves, while it learns feedback.

Supervised steps on a few corrections move a small model broadly: on SmolLM2, teaching ten invented facts by SFT
(r=16 on every projection) raised the perplexity of held-out ShareGPT replies by tens of percent by the time they
were recalled, and more with every step (docs/benchmarks.md, "Teaching without forgetting"), half of it on a few
percent of the tokens,
which the model had become sure of (a reply now "must" start with "The"). The remedy is the reference-model KL
that TRL's preference trainers and PPO keep: each optimizer step also minimises ``anchor_weight`` x
KL(base || adapted) on the response positions of recent **served** completions (people's own traffic, never one
that got feedback, nor one whose prompt got feedback), the base model being the served model with the adapter
off (as PEFT's ``disable_adapter`` gives TRL its reference).

- ``references_slices``: the base model's top-k log-probabilities at each response position (``Targets``),
  computed once per anchor (several anchors' in one forward of prompt + response without the adapter) and kept
  with it. The loss
  (``alchemist.training.losses.kl_to_targets``) is the KL restricted to those k tokens, sum_j p_j (log p_j -
  log q_j): its gradient is the soft cross-entropy's. k = 32 keeps 0.96 of SmolLM2's next-token mass at the
  median position of held-out ShareGPT replies, 0.89 on average (``docs/profiles/top_k_mass.py``).
- ``AnchorPool``: the most recent served completions (bounded), fed by the server as responses finish; a prompt
  someone gave feedback on is excluded for good (its anchor would pull against the correction).
- ``BatchAnchors``: a batch's anchors, the pool's most recent and the next known facts, with their targets.
- ``known_fact_anchors``: well-known facts asked and answered (``known_facts.json``: capitals, authors, inventors,
  years, rivers; none of them one of the evaluation gate's canaries), a few of them beside the served anchors in
  every step. Served chat rarely asks what a correction's template resembles, and a fact taught in one ("The
  capital of Durnholt is Saltreach.") moved the model's answers to real ones ("What is the capital of Spain?"): the
  gate blocked every version after a few more facts (docs/benchmarks.md, "Learning with the defaults").

An anchor is trained like any sample: replayed from its prompt's record when there is a fresh one, recomputed
otherwise; only its loss differs (``alchemist.training.losses``).
"""

from __future__ import annotations

import json
import math
import threading
from collections import OrderedDict
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from alchemist.config.training import AnchorsConfig
from alchemist.model.llama import Adapter, Llama
from alchemist.model.tokenizer import Tokenizer
from alchemist.training.losses import Targets, log_probs
from alchemist.training.recompute import responses_hidden_slices
from alchemist.training.trainer import Sample


@torch.no_grad()
def references_slices(
    model: Llama, samples: Sequence[tuple[list[int], list[int]]], top_k: int, reference: Adapter | None = None
) -> Generator[None, None, list[Targets]]:
    """The base model's (no adapter; with ``reference``, that adapter's) top-k log-probabilities at the response
    positions P-1..P+R-2 of each (prompt ids, response ids), from one forward over all of them, in slices: each
    layer of the forward, then each anchor's top-k over the vocabulary (the whole forward of a group of four long
    anchors was a wait of seconds for serving: docs/benchmarks.md, "Why the defaults", slices)."""
    pairs = [(torch.tensor(p, device=model.device), torch.tensor(r, device=model.device)) for p, r in samples]
    targets = []
    for hidden in (yield from responses_hidden_slices(model, reference, pairs)):
        if targets:
            yield
        logprobs = log_probs(model.logits(hidden))
        top = logprobs.topk(min(top_k, logprobs.shape[-1]), dim=-1)
        targets.append(Targets(top.indices, top.values))
    return targets


@dataclass
class Anchor:
    """A served completion to stay close on. Its prompt's record, if a policy made one, is keyed by its
    ``response_id`` (as every record is)."""

    response_id: str
    prompt_ids: list[int]
    response_ids: list[int]
    targets: Targets | None = None  # computed by the trainer the first time the anchor is used


KNOWN_FACTS_FILE = Path(__file__).with_name("known_facts.json")


def known_fact_anchors(tokenizer: Tokenizer) -> list[Anchor]:
    """Each known fact of ``known_facts.json`` as an anchor: its question as a user asks it, its answer as a reply
    (no record: trained by recompute, a short prompt)."""
    facts = json.loads(KNOWN_FACTS_FILE.read_text())
    return [Anchor(f"known-fact-{i}", tokenizer.user_prompt(f["user"]), tokenizer.encode_reply(f["assistant"]))
            for i, f in enumerate(facts)]  # fmt: skip


def _prompt_key(prompt_ids: list[int]) -> int:
    """A prompt's identity in the pool: a hash, so that excluded prompts cost a number each, not their tokens (a
    collision only keeps one more completion out of the pool)."""
    return hash(tuple(prompt_ids))


class AnchorPool:
    """Thread-safe: the ``max_size`` most recent served completions, minus those whose prompt got feedback."""

    def __init__(self, max_size: int = 256, max_excluded: int = 100_000) -> None:
        if max_size <= 0:
            raise ValueError(f"max_size must be positive (got {max_size!r})")
        self.max_size = max_size
        self.max_excluded = max_excluded
        self._anchors: OrderedDict[str, Anchor] = OrderedDict()  # oldest first
        self._excluded: OrderedDict[int, None] = OrderedDict()  # keys of prompts with feedback
        self._lock = threading.Lock()

    def offer(self, anchor: Anchor) -> None:
        """A completion finished: keep it as a candidate anchor (unless its prompt got feedback)."""
        if not anchor.response_ids or not anchor.prompt_ids:
            return
        with self._lock:
            if _prompt_key(anchor.prompt_ids) in self._excluded:
                return
            self._anchors[anchor.response_id] = anchor
            while len(self._anchors) > self.max_size:
                self._anchors.popitem(last=False)

    def exclude(self, response_id: str, prompt_ids: list[int]) -> None:
        """Feedback arrived on this response: neither it nor any completion of the same prompt is an anchor."""
        key = _prompt_key(prompt_ids)
        with self._lock:
            self._anchors.pop(response_id, None)
            for rid in [rid for rid, a in self._anchors.items() if _prompt_key(a.prompt_ids) == key]:
                del self._anchors[rid]
            self._excluded[key] = None
            self._excluded.move_to_end(key)
            while len(self._excluded) > self.max_excluded:
                self._excluded.popitem(last=False)

    def recent(self, count: int, max_rows: float = math.inf, max_response: int | None = None) -> list[Anchor]:
        """The ``count`` most recent anchors, newest first, that fit in ``max_rows`` rows together (an anchor's
        rows: its prompt and its response's first ``max_response`` tokens, less one); one that does not fit in what
        is left is passed over for older ones."""
        taken: list[Anchor] = []
        with self._lock:
            for anchor in reversed(self._anchors.values()):
                if len(taken) == count:
                    break
                rows = len(anchor.prompt_ids) + len(anchor.response_ids[:max_response]) - 1
                if rows <= max_rows:
                    taken.append(anchor)
                    max_rows -= rows
        return taken

    def __len__(self) -> int:
        with self._lock:
            return len(self._anchors)


class BatchAnchors:
    """Each batch's anchors: the most recent served completions of ``pool`` and the next of ``known_facts`` (taken
    in turn, batch by batch), each with the base model's top-k distribution there, computed once per anchor."""

    def __init__(self, model: Llama, pool: AnchorPool, known_facts: list[Anchor], config: AnchorsConfig,
                 group_size: int, reference: Adapter | None = None) -> None:  # fmt: skip
        """``reference``: what the anchors keep the adapter close to, over the base model (None: the base model
        alone; a named adapter as loaded, which its trainer must not pull back to the base model)."""
        self.model, self.pool, self.known_facts = model, pool, known_facts
        self.reference = reference
        self.config, self.group_size = config, group_size
        self.known_next = 0  # the next known fact to anchor on

    def slices(self) -> Generator[None, None, list[Sample]]:
        """The batch's anchors: the most recent served completions (their responses' first ``max_tokens``;
        ``max_rows`` rows at most together) and the next known facts, each with the base model's top-k
        distribution there (computed once per anchor, ``group_size`` anchors per forward, a slice per layer)."""
        c = self.config
        if not c.weight:
            return []
        served = self.pool.recent(c.samples, c.max_rows or math.inf, c.max_tokens)
        anchors = [(anchor, anchor.response_ids[: c.max_tokens]) for anchor in served + self._next_known_facts()]
        new = [(anchor, response) for anchor, response in anchors if anchor.targets is None]
        for start in range(0, len(new), self.group_size):
            group = new[start : start + self.group_size]
            pairs = [(a.prompt_ids, r) for a, r in group]
            targets = yield from references_slices(self.model, pairs, c.top_k, self.reference)
            for (anchor, _), anchor_targets in zip(group, targets, strict=True):
                anchor.targets = anchor_targets
            yield
        return [Sample(a.prompt_ids, response, a.response_id, a.targets) for a, response in anchors]

    def _next_known_facts(self) -> list[Anchor]:
        """The batch's ``known_facts`` known facts: the next ones of the list, in turn."""
        facts = self.known_facts
        count = min(self.config.known_facts, len(facts))
        start, self.known_next = self.known_next, (self.known_next + count) % max(len(facts), 1)
        return [facts[(start + i) % len(facts)] for i in range(count)]


def in_turn(anchors: list[Sample], step: int, turn: int, replicas: int = 1, rank: int = 0) -> list[Sample]:
    """The anchors of a batch's ``step`` when they are spread over ``turn`` steps: every ``turn``-th one, from the
    step's place in the turn on (served and known facts alike spread, as they are listed). One of ``replicas`` in
    lockstep (``rank``) spreads its own over a turn ``replicas`` times longer, from its own places in it: a step
    over all of them holds as many as one process's, and of a list every replica has (the known facts) each takes
    other ones."""
    turn, step = turn * replicas, step * replicas + rank
    return anchors[step % turn :: turn] if turn > 1 else anchors
