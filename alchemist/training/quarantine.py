"""Poisoning guard: feedback whose loss is not finite or far above the running level is not trained, but held
in quarantine, visible and releasable by an admin (GET /v1/quarantine, POST /v1/quarantine/release).

    guard = LossGuard(spike_factor=4.0, warmup=8)
    reasons = guard.check([1.9, float("nan"), 14.2])   # [None, "loss is nan", "loss 14.2 > 4 x the running level 2"]
    quarantine = Quarantine(feedback_log)
    quarantine.hold(entry, reason, loss); quarantine.release([seq]); quarantine.list()

Why per sample and before the update: a correction that teaches garbage (or a NaN from a broken record) shows as
one sample's loss far above its peers', on the weights it is about to change; the batch is trained again without
it. Held is a state of the entry in the feedback log (the trainer's queue): it stays out of training across
restarts, and the trainer's position moves past it (settled for now). A released entry is queued again, first in
line, and trained unchecked (an admin vouched for it); it leaves the list once trained.

Which objectives are guarded: SFT samples, with a level per kind (corrections, and served answers rated 1 trained
by SFT, whose loss is far lower), since a correction is text anyone can send. KTO and DPO samples are checked for
NaN/inf only: their responses are the model's own served outputs (nothing foreign to poison with), and their
losses are bounded sigmoids of the adapter's drift from the base model, not a measure of how odd the text is.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from alchemist.feedback.log import FeedbackEntry, FeedbackLog
from alchemist.training.feedback_batch import Item


class LossGuard:
    """Flags sample losses that are NaN/inf, or above ``spike_factor`` x the running level (the mean of accepted
    losses, exponential with ``decay`` once it has seen enough) once ``warmup`` losses were seen. ``spike_factor``
    0 checks finiteness only."""

    def __init__(self, spike_factor: float, warmup: int = 8, decay: float = 0.9):
        self.spike_factor = spike_factor
        self.warmup = warmup
        self.decay = decay
        self.level: float | None = None
        self.seen = 0

    def check(self, losses: list[float]) -> list[str | None]:
        """A reason for each suspect loss, None for the others (which then update the running level)."""
        reasons = []
        for loss in losses:
            if not math.isfinite(loss):
                reasons.append(f"loss is {loss}")
            elif self.spike_factor and self.seen >= self.warmup and loss > self.spike_factor * self.level:
                reasons.append(f"loss {loss:.3g} > {self.spike_factor:g} x the running level {self.level:.3g}")
            else:
                reasons.append(None)
        for loss, reason in zip(losses, reasons, strict=True):
            if reason is None:  # the mean of the warm-up losses, then an exponential mean
                weight = max(1.0 - self.decay, 1.0 / (self.seen + 1))
                self.level = loss if self.level is None else (1 - weight) * self.level + weight * loss
                self.seen += 1
        return reasons


class PoisoningGuard:
    """A batch's suspects: each sample's loss against its kind's level. SFT's levels are per kind (the model's own
    answers rated 1 have a far lower loss than corrections); KTO's and DPO's losses are bounded and their responses
    the model's own: NaN/inf only (spike factor 0)."""

    def __init__(self, spike_factor: float, warmup: int):
        self.levels = {"correction": LossGuard(spike_factor, warmup), "rated": LossGuard(spike_factor, warmup),
                       "kto": LossGuard(0.0), "dpo": LossGuard(0.0)}  # fmt: skip

    def suspects(self, samples: list[tuple[FeedbackEntry, Item, float]]) -> dict[int, tuple[str, float]]:
        """(entry, item, loss) of each sample -> {seq: (reason, loss)} of the entries to hold; entries released from
        quarantine are not checked (an admin vouched for them), a DPO pair's two samples are one entry."""
        checked: dict[str, list[tuple[int, float]]] = {}
        for entry, it, loss in samples:
            if entry.released_s is None:
                checked.setdefault(_kind(entry, it), []).append((entry.seq, loss))
        suspects: dict[int, tuple[str, float]] = {}
        for kind, losses in checked.items():
            reasons = self.levels[kind].check([loss for _, loss in losses])
            for (seq, loss), reason in zip(losses, reasons, strict=True):
                if reason is not None:
                    suspects.setdefault(seq, (reason, loss))
        return suspects


def _kind(entry: FeedbackEntry, it: Item) -> str:
    if it.objective == "sft":
        return "correction" if entry.correction is not None else "rated"
    return it.objective


class Quarantine:
    """The held entries are the feedback log's "quarantined" ones (a state, so a restart keeps them held and
    GET /v1/feedback/{id} shows it); this is the trainer's and the admin endpoints' view of them. Thread-safe."""

    def __init__(self, log: FeedbackLog, on_release: Callable[[], None] = lambda: None):
        self.log = log
        self.on_release = on_release  # the trainer's queue reads the log again: released entries train next

    def hold(self, entry: FeedbackEntry, reason: str, loss: float) -> bool:
        """False if the entry was no longer queued (settled meanwhile)."""
        return self.log.mark_quarantined(entry.seq, reason, loss)

    def is_held(self, seq: int) -> bool:
        entry = self.log.get(seq)
        return entry is not None and entry.state == "quarantined"

    def release(self, seqs: list[int]) -> list[int]:
        """Held entries among ``seqs`` go back to the queue, first in line and exempt from the guard; returns
        those that were held."""
        released = self.log.release(seqs)
        if released:
            self.on_release()
        return released

    def list(self) -> list[dict]:
        """Held entries, and released ones not trained yet."""
        return [
            {
                "seq": e.seq,
                "response_id": e.response_id,
                "reason": e.quarantine_reason,
                "loss": _json_loss(e.quarantine_loss),
                "held_at": e.quarantined_s,
                "released": e.released_s is not None,
            }
            for e in self.log.quarantined()
        ]


def _json_loss(loss: float | None) -> float | str:
    """JSON has no NaN or inf: those are named (SQLite keeps NaN as NULL)."""
    if loss is None:
        return "nan"
    return loss if math.isfinite(loss) else str(loss)
