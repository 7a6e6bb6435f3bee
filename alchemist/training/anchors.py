"""Anchors: keep the served model close to the base model on the traffic it serves, while it learns feedback.

Supervised steps on a few corrections move a small model broadly: on SmolLM2, teaching ten invented facts by SFT
(r=16 on every projection) raised the perplexity of held-out ShareGPT replies by 55-100% at every learning rate and
step count that taught them, most of it on a few tokens the model became sure of (a reply now "must" start with
"The"). The remedy is the reference-model KL that TRL's preference trainers and PPO keep: each optimizer step also
minimises ``anchor_weight`` x KL(base || adapted) on the response positions of recent **served** completions
(people's own traffic, never one that got feedback, nor one whose prompt got feedback), the base model being the
served model with the adapter off (as PEFT's ``disable_adapter`` gives TRL its reference).

- ``Targets``: the base model's top-k log-probabilities at each response position, computed once per anchor
  (``reference_targets``: one forward of prompt + response without the adapter) and kept with it. The loss is the
  KL restricted to those k tokens, sum_j p_j (log p_j - log q_j): its gradient is the soft cross-entropy's; k = 32
  holds almost all of the mass of a chat model's next-token distribution.
- ``AnchorPool``: the most recent served completions (bounded), fed by the server as responses finish; a prompt
  someone gave feedback on is excluded for good (its anchor would pull against the correction).

An anchor is trained like any sample: replayed from its prompt's record when there is a fresh one, recomputed
otherwise; only its loss differs (``alchemist.training.recompute.response_loss``).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from alchemist.model.attention import AttentionMetadata
from alchemist.model.llama import Llama


@dataclass(frozen=True)
class Targets:
    """The reference distribution at each of R response positions, top-k: token ids (R, k), log-probs (R, k)."""

    ids: torch.Tensor
    logprobs: torch.Tensor


def kl_to_targets(logits: torch.Tensor, targets: Targets) -> torch.Tensor:
    """Mean over positions of sum_j p_j (log p_j - log q_j), j over the targets' top-k tokens; logits (R, vocab)."""
    logq = F.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    logp = targets.logprobs.to(logq.dtype)
    return (logp.exp() * (logp - logq.gather(-1, targets.ids))).sum(-1).mean()


@torch.no_grad()
def reference_targets(model: Llama, prompt_ids: list[int], response_ids: list[int], top_k: int) -> Targets:
    """The base model's (no adapter) top-k log-probabilities at the response positions P-1..P+R-2."""
    ids = torch.tensor([*prompt_ids, *response_ids[:-1]], device=model.device)
    hidden = model(ids, torch.arange(len(ids), device=ids.device), AttentionMetadata.single(len(ids)), adapter=None)
    logits = model.logits(hidden[len(prompt_ids) - 1 :])
    top = F.log_softmax(logits.float(), dim=-1).topk(min(top_k, logits.shape[-1]), dim=-1)
    return Targets(top.indices, top.values)


@dataclass
class Anchor:
    """A served completion to stay close on; ``record_id`` names its prompt's record (if it was recorded)."""

    response_id: str
    prompt_ids: list[int]
    response_ids: list[int]
    record_id: str | None = None
    targets: Targets | None = None  # computed by the trainer the first time the anchor is used


class AnchorPool:
    """Thread-safe: the ``max_size`` most recent served completions, minus those whose prompt got feedback."""

    def __init__(self, max_size: int = 256, max_excluded: int = 100_000) -> None:
        if max_size <= 0:
            raise ValueError(f"max_size must be positive (got {max_size!r})")
        self.max_size = max_size
        self.max_excluded = max_excluded
        self._anchors: OrderedDict[str, Anchor] = OrderedDict()  # oldest first
        self._excluded: OrderedDict[tuple[int, ...], None] = OrderedDict()  # prompts with feedback
        self._lock = threading.Lock()

    def offer(self, anchor: Anchor) -> None:
        """A completion finished: keep it as a candidate anchor (unless its prompt got feedback)."""
        if not anchor.response_ids or not anchor.prompt_ids:
            return
        with self._lock:
            if tuple(anchor.prompt_ids) in self._excluded:
                return
            self._anchors[anchor.response_id] = anchor
            while len(self._anchors) > self.max_size:
                self._anchors.popitem(last=False)

    def exclude(self, response_id: str, prompt_ids: list[int]) -> None:
        """Feedback arrived on this response: neither it nor any completion of the same prompt is an anchor."""
        key = tuple(prompt_ids)
        with self._lock:
            self._anchors.pop(response_id, None)
            for rid in [rid for rid, a in self._anchors.items() if tuple(a.prompt_ids) == key]:
                del self._anchors[rid]
            self._excluded[key] = None
            self._excluded.move_to_end(key)
            while len(self._excluded) > self.max_excluded:
                self._excluded.popitem(last=False)

    def recent(self, count: int) -> list[Anchor]:
        """The ``count`` most recent anchors, newest first."""
        with self._lock:
            return list(reversed(self._anchors.values()))[:count]

    def __len__(self) -> int:
        with self._lock:
            return len(self._anchors)
