"""Training's counters, one set: the ``Trainer`` counts its passes and replays, the ``OnlineTrainer`` its batches.

/metrics and the dashboard read them from another thread while a batch goes on (``alchemist.server.metrics``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class TrainingStats:
    # --- passes (Trainer): a sample counts once per epoch; an anchor is a served completion kept close to the base
    steps: int = 0  # optimizer steps
    samples: int = 0  # feedback sample passes
    response_tokens: int = 0  # their response tokens
    replayed: int = 0  # feedback sample passes replayed from a record
    recomputed: int = 0  # ... and recomputed
    anchor_samples: int = 0  # anchor passes
    anchor_tokens: int = 0
    anchor_replayed: int = 0
    # --- passes without gradient (FeedbackBatch: alchemist.training.logp_passes), replayed from a record or not
    reference_replayed: int = 0  # the base model's log-probabilities (KTO, DPO), from records the base model made
    reference_recomputed: int = 0
    kl_replayed: int = 0  # KTO's reference point: the adapter's log-probabilities of the mismatched pairs
    kl_recomputed: int = 0
    # --- records (Trainer): why a pass was recomputed, and what a replay read
    stale: int = 0  # records found but too old for the current adapter (recomputed)
    missing: int = 0  # no record, or one that does not cover the prompt (recomputed)
    # replayed records (anchors' too) by how many adapter versions they lagged behind: keys 0..max_staleness only
    staleness_used: Counter[int] = field(default_factory=Counter)
    unreadable: int = 0  # replays abandoned because the record went bad or away mid-read (then recomputed)
    layers_reloaded: int = 0  # walk layers read back from the store
    layers_recomputed: int = 0  # walk layers recomputed from their recorded input instead (hedging)
    record_bytes_read: int = 0
    # --- data-parallel steps (Trainer with DataParallel): their collectives, launch to completion
    allreduce_s: float = 0.0  # all steps' gradient all-reduces (the replicas having met: moving the gradients)
    sync_s: float = 0.0  # all steps' meeting points (alchemist.training.data_parallel): waiting for the others, mostly
    last_allreduce_s: float = 0.0  # the last step's (against StepResult.step_s: the collective's share of a step)
    # --- batches (OnlineTrainer)
    skipped: dict[str, int] = field(default_factory=dict)  # entries the queue skipped, by why ("empty", "backlog")
    last_loss: float | None = None
    last_tokens_per_s: float = 0.0  # training tokens / training time, of the last batch
    train_s: float = 0.0  # time spent in training slices
    last_anchor_kl: float | None = None  # mean KL(base || adapted) of the last step's anchors
    quarantined: int = 0  # entries held by the poisoning guard (alchemist.training.quarantine)
    unpromoted: int = 0  # versions the evaluation gate kept from serving
    evaluation_s: float = 0.0  # time spent in the gate's slices (alchemist.training.evaluation)
    learned_checks: int = 0  # passes asking whether a batch's corrections are learned (before its steps end)
    carried: int = 0  # corrections a batch that yielded left queued, not learned yet, for the next batch

    @property
    def staleness_sum(self) -> int:
        """Adapter versions behind, summed over replayed records."""
        return sum(lag * count for lag, count in self.staleness_used.items())

    def count_logp_pass(self, kind: str, replayed: bool) -> None:
        """A pass without gradient of ``kind`` ("reference" or "kl")."""
        name = f"{kind}_{'replayed' if replayed else 'recomputed'}"
        setattr(self, name, getattr(self, name) + 1)

    def count_pass(self, response_tokens: int, replayed: bool, anchor: bool) -> None:
        if anchor:
            self.anchor_samples += 1
            self.anchor_tokens += response_tokens
            self.anchor_replayed += replayed
        else:
            self.samples += 1
            self.response_tokens += response_tokens
            self.replayed += replayed
            self.recomputed += not replayed
