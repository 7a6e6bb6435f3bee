"""A mini-batch's steps summed up: the metrics its checkpoint keeps (``alchemist.training.checkpoint``) and the last
batch's numbers that /metrics shows (``TrainingStats.last_*``).

Each step's passes are in the order the online trainer gives its samples: the batch's own (feedback), then the
rehearsed corrections, then the anchors (``alchemist.training.online``).
"""

from __future__ import annotations

from alchemist.training.feedback_batch import FeedbackBatch
from alchemist.training.stats import TrainingStats
from alchemist.training.trainer import Sample, StepResult


def batch_metrics(
    feedback: FeedbackBatch,
    rehearsed: list[Sample],
    anchors: list[Sample],
    steps: list[tuple[list[Sample], StepResult]],
    stats: TrainingStats,
    job_s: float,
) -> dict:
    """The batch's steps (each: its feedback samples and its result) summed up for its checkpoint; the last ones go
    to ``stats`` too. ``job_s``: the batch's own time so far, its slices (serving steps ran in between)."""
    losses = [_mean([loss for loss, _ in step.passes[: len(samples)]]) for samples, step in steps]  # none: 0 (lockstep)
    first, last = steps[0], steps[-1]
    rehearsal = [[loss for loss, _ in step.passes[len(samples) : len(samples) + len(rehearsed)]]
                 for samples, step in (first, last)]  # fmt: skip
    kls = [_mean([loss for loss, _ in step.passes[len(samples) + len(rehearsed) :]]) for samples, step in steps]
    tokens = sum(len(s.response_ids) for samples, _ in steps for s in samples)
    stats.last_loss = losses[-1]
    stats.last_anchor_kl = kls[-1] if anchors else None
    # The batch's own time: its slices (serving steps ran in between), all but this last short one.
    stats.last_tokens_per_s = tokens / job_s if job_s > 0 else 0.0
    return {
        "loss": losses[-1],
        "first_epoch_loss": losses[0],
        "losses": _mean_by_objective(steps[-1][0], steps[-1][1].passes),  # the last epoch's, per objective
        "samples": len(feedback),
        "objectives": {"sft": len(feedback.sft), "kto": len(feedback.kto), "dpo": len(feedback.dpo)},
        "epochs": len(losses),
        "response_tokens": tokens,
        "anchors": len(anchors),
        "anchor_kl": kls[-1] if anchors else None,
        "rehearsed": len(rehearsed),  # and their mean loss at the first step and the last
        "rehearsal_loss": [sum(r) / len(r) for r in rehearsal] if rehearsed else None,
    }


def _mean_by_objective(samples: list[Sample], results: list[tuple[float, bool]]) -> dict[str, float]:
    """The mean loss of each objective's samples (a DPO pair's loss is on both of its samples)."""
    by: dict[str, list[float]] = {}
    for sample, (loss, _) in zip(samples, results, strict=False):  # results go on with the anchors
        by.setdefault("sft" if sample.term is None else sample.term.kind, []).append(loss)
    return {kind: sum(values) / len(values) for kind, values in by.items()}


def _mean(values: list[float]) -> float:
    return sum(values) / max(len(values), 1)
