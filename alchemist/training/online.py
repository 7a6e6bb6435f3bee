"""The online trainer: the feedback log becomes LoRA updates that the engine serves minutes later.

    trainer = OnlineTrainer(engine, feedback_log, AdapterCheckpoints(dir, keep), OnlineConfig())
    while serving:                       # the server's step loop (alchemist.server.async_engine)
        engine.step()
        if trainer.has_work(): trainer.run_slice()

The story of one mini-batch: read the next ``sft`` entries of the log -> samples (prompt, response to learn, the
prompt's record) -> ``epochs`` optimizer steps, each sample replayed from its record where the record is fresh
enough, recomputed otherwise -> publish the new adapter version to the engine -> checkpoint it (adapter, optimizer
state, the log position of the batch's last entry, its metrics) atomically. "negative" and "preference" entries
are passed over (counted; a later objective trains on them). Each step also keeps the adapted model close to the
base model on recent served traffic: ``anchor_weight`` x KL(base || adapted) over ``anchor_samples`` anchors
(``alchemist.training.anchors``; replayed from their records too).

Exactly once: the position in the log moves only with a checkpoint. A crash before it loses the batch's update,
and the restarted trainer (``restore``) reads the same entries again from the checkpointed position; a crash after
it never sees them again. Acknowledged feedback is in the log before the server answers, so none is lost.

Slices: all work is done in small slices (half a layer of a replay walk, a layer of the anchors' reference forward
or of a publish's merge, a sample's loss, a recomputed group of samples trained together, an update, a checkpoint)
from the thread that steps the engine, between its steps: serving waits for the slice in progress, so none may be
long (groups are capped in rows: ``group_max_tokens``). Training never runs concurrently with serving: on this CPU
that slowed decode steps 3.5-4x (design note, section 12). ``train_share`` bounds training's share of time while
requests are in flight (the step loop's accounting); with none in flight, training takes what is free.

Rollback serves an earlier version again, as a new version (numbers only grow, so records' staleness stays
meaningful): the adapter and optimizer state of the earlier version become the trainer's, the log position stays
(feedback trained since is not trained again). It waits for the batch in training to be checkpointed first.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Generator
from dataclasses import dataclass, field

from alchemist.config import OnlineConfig
from alchemist.engine import LLMEngine
from alchemist.feedback.log import FeedbackEntry, FeedbackLog
from alchemist.model.lora import LoraAdapter, LoraConfig
from alchemist.training.anchors import AnchorPool, references_slices
from alchemist.training.checkpoint import AdapterCheckpoints
from alchemist.training.quarantine import LossGuard, Quarantine
from alchemist.training.trainer import Sample, Trainer, TrainerConfig

logger = logging.getLogger(__name__)
GUARD_KINDS = ("correction", "rated")  # sft entries: a correction, or a served answer rated 1


def _guard_kind(entry: FeedbackEntry) -> str:
    return "correction" if entry.correction is not None else "rated"


@dataclass
class OnlineStats:
    """What /metrics and /v1/adapters show about training."""

    steps: int = 0
    samples: int = 0  # sample passes (a sample counts once per epoch)
    response_tokens: int = 0  # tokens trained on, summed over sample passes
    replayed: int = 0
    recomputed: int = 0
    skipped: dict[str, int] = field(default_factory=dict)  # log entries of kinds not trained yet, by kind
    last_loss: float | None = None
    last_tokens_per_s: float = 0.0  # training tokens / training time, of the last batch
    train_s: float = 0.0  # time spent in training slices
    staleness_sum: int = 0  # adapter versions behind, summed over replayed records
    anchor_samples: int = 0  # anchor passes (a served completion kept close to the base model), once per epoch
    anchor_tokens: int = 0
    anchor_replayed: int = 0
    last_anchor_kl: float | None = None  # mean KL(base || adapted) of the last step's anchors
    quarantined: int = 0  # samples held by the poisoning guard (alchemist.training.quarantine)


class OnlineTrainer:
    def __init__(
        self, engine: LLMEngine, log: FeedbackLog, checkpoints: AdapterCheckpoints, config: OnlineConfig
    ) -> None:
        self.engine = engine
        self.log = log
        self.checkpoints = checkpoints
        self.config = config
        model = engine.model
        lora = LoraConfig(r=config.lora_r, alpha=config.lora_alpha)
        self.adapter = LoraAdapter(model.config, lora, device=model.device, seed=config.seed)
        self.trainer = Trainer(
            model,
            self.adapter,
            engine.store,
            TrainerConfig(
                lr=config.lr,
                max_grad_norm=config.max_grad_norm,
                max_staleness=config.max_staleness,
                replay=config.replay,
                prefetch_depth=config.prefetch_depth,
                group_size=config.group_size,
                group_max_tokens=config.group_max_tokens,
            ),
        )
        self.anchors = AnchorPool(config.anchor_pool_size)  # the server offers finished completions
        self.stats = OnlineStats()
        # A level per kind of sample: the model's own answers rated 1 have a far lower loss than corrections do.
        self.guards = {kind: LossGuard(config.loss_spike_factor, config.loss_spike_warmup) for kind in GUARD_KINDS}
        self.quarantine = Quarantine(checkpoints.directory.parent / "quarantine.json")
        self.position = 0  # seq of the last log entry whose training is checkpointed
        self._read_position = 0  # seq of the last entry taken into a batch (>= position)
        self._batch: list[FeedbackEntry] = []  # sft entries waiting for a step
        self._job: Generator[None, None, None] | None = None
        self._job_s = 0.0  # time spent in the slices of the batch in progress
        # A slice, a look for new work and a rollback never interleave (reentrant: run_slice looks for work too).
        self._lock = threading.RLock()
        self._idle = threading.Condition(self._lock)  # notified when a batch's job ends (rollbacks wait for it)
        self._rollbacks_waiting = 0  # while > 0, no new batch starts: a rollback goes at the next batch boundary
        self.restore()

    # --- state ---------------------------------------------------------------------------------------------------

    def restore(self) -> None:
        """Continue from the latest checkpoint (if any): its adapter served, its optimizer state, its position."""
        latest = self.checkpoints.latest()
        if latest is None:
            return
        self._load(latest.version)
        self.adapter.version = latest.version
        self.position = self._read_position = latest.log_position
        self.engine.set_adapter(self.adapter, latest.version)
        logger.info("online trainer: resumed at adapter version %d, log position %d", latest.version, self.position)

    def _load(self, version: int) -> None:
        model = self.engine.model
        adapter, optimizer_state, _ = self.checkpoints.load(version, model.config, model.device)
        if adapter.config.r != self.adapter.config.r or adapter.config.alpha != self.adapter.config.alpha:
            raise ValueError(
                f"adapter version {version} has r={adapter.config.r}, alpha={adapter.config.alpha}; this trainer is "
                f"configured with lora_r={self.config.lora_r}, lora_alpha={self.config.lora_alpha}"
            )
        self.adapter.load_state_dict(adapter.state_dict())
        self.trainer.optimizer.load_state_dict(optimizer_state)

    @property
    def version(self) -> int:
        return self.adapter.version

    # --- the step loop's interface -------------------------------------------------------------------------------

    def has_work(self) -> bool:
        if not self.config.enabled:
            return False
        with self._lock:
            if self._job is not None:
                return True
            self._take_released()
            self._read_new()
            if not self._batch:
                return False
            waited_s = time.time() - self._batch[0].created_s
            return len(self._batch) >= self.config.batch_size or waited_s >= self.config.max_wait_s

    def run_slice(self) -> float:
        """One slice of training work; returns the seconds it took."""
        t0 = time.perf_counter()
        with self._lock:
            if self._job is None:
                if self._rollbacks_waiting or not self.has_work():
                    return 0.0
                batch, self._batch = self._batch[: self.config.batch_size], self._batch[self.config.batch_size :]
                self._job = self._train(batch)
            try:
                next(self._job)
            except StopIteration:
                self._job = None
            except Exception:
                # Nothing acknowledged is lost: the position did not move, the entries are read again later.
                logger.exception("online training failed; its batch will be read again")
                self._abandon()
            if self._job is None:
                self._idle.notify_all()
        elapsed = time.perf_counter() - t0
        self.stats.train_s += elapsed
        self._job_s += elapsed
        return elapsed

    def _read_new(self) -> None:
        for entry in self.log.read(after_seq=self._read_position, limit=max(64, self.config.batch_size)):
            self._read_position = entry.seq
            self.anchors.exclude(entry.response_id, entry.prompt_token_ids)
            kind = entry.kind
            if self.quarantine.is_held(entry.seq):
                kind = "quarantined"
            elif kind == "sft" and not (entry.prompt_token_ids and entry.response_token_ids):
                kind = "invalid"  # nothing to learn (an empty served output): never a poison pill for the loop
            if kind == "sft":
                self._batch.append(entry)
            else:
                self.stats.skipped[kind] = self.stats.skipped.get(kind, 0) + 1

    def _take_released(self) -> None:
        """Entries an admin released from quarantine go first into the next batch (they are behind the position)."""
        waiting = {e.seq for e in self._batch}
        for seq in self.quarantine.released():
            if seq not in waiting:
                entry = next(iter(self.log.read(after_seq=seq - 1, limit=1)), None)
                if entry is not None and entry.seq == seq:
                    self._batch.insert(0, entry)

    def _abandon(self) -> None:
        """Drop the batch in progress: back to the latest checkpoint's adapter and optimizer state (epochs already
        applied must not count), and read the log again from its position."""
        self._job = None
        self._batch.clear()
        self.trainer.optimizer.zero_grad(set_to_none=True)
        latest = self.checkpoints.latest()
        if latest is not None:
            self._load(latest.version)
            self.adapter.version = latest.version
        else:
            self._load_initial()
            self.adapter.version = 0
        self._read_position = self.position

    def _load_initial(self) -> None:
        """The adapter as it starts (B = 0: it serves exactly the base model's outputs), a fresh optimizer."""
        initial = LoraAdapter(self.adapter.model_config, self.adapter.config, seed=self.config.seed)
        self.adapter.load_state_dict(initial.state_dict())
        self.trainer.optimizer.state.clear()

    # --- one mini-batch ------------------------------------------------------------------------------------------

    def _train(self, batch: list[FeedbackEntry]) -> Generator[None, None, None]:
        # A record is keyed by its response id; any policy may have made one (not only a request's flag): look.
        samples = [Sample(e.prompt_token_ids, e.response_token_ids, e.response_id) for e in batch]
        anchors = yield from self._anchor_samples()
        losses, kls, tokens = [], [], 0
        self._job_s = 0.0
        passes = samples + anchors
        scales = [self.config.anchor_weight / len(anchors) if s.targets is not None else 1.0 / len(samples)
                  for s in passes]  # fmt: skip
        for epoch in range(self.config.epochs):
            results = yield from self.trainer.backward_batch_slices(passes, scales, self._count)
            if epoch == 0 and self._hold_suspects(batch, [loss for loss, _ in results[: len(samples)]]):
                return  # no update: the batch is trained again without them
            losses.append(sum(loss for loss, _ in results[: len(samples)]) / len(samples))
            kls.append(sum(loss for loss, _ in results[len(samples) :]) / max(len(anchors), 1))
            tokens += sum(len(s.response_ids) for s in samples)
            yield
            self.trainer.update()
            self.stats.steps += 1
            yield
        self.stats.last_loss = losses[-1]
        self.stats.last_anchor_kl = kls[-1] if anchors else None
        # The batch's own time: its slices (serving steps ran in between), all but this last short one.
        self.stats.last_tokens_per_s = tokens / self._job_s if self._job_s > 0 else 0.0
        yield from self.engine.set_adapter_slices(self.adapter, self.version)  # merged here, a layer per slice
        yield
        metrics = {
            "loss": losses[-1],
            "first_epoch_loss": losses[0],
            "samples": len(samples),
            "epochs": self.config.epochs,
            "response_tokens": tokens,
            "seqs": [e.seq for e in batch],
            "anchors": len(anchors),
            "anchor_kl": kls[-1] if anchors else None,
        }
        state = self.trainer.optimizer.state_dict()
        yield from self.checkpoints.save_slices(self.version, self.adapter, state, batch[-1].seq, metrics)
        self.position = batch[-1].seq
        self.quarantine.trained([e.seq for e in batch])

    def _hold_suspects(self, batch: list[FeedbackEntry], losses: list[float]) -> bool:
        """Quarantines the batch's samples whose loss the guard flags (released ones are exempt), drops the
        gradients, and puts the others back to wait for the next batch; False if none is flagged."""
        released = set(self.quarantine.released())
        suspects = []
        for kind, guard in self.guards.items():
            checked = [(e, loss) for e, loss in zip(batch, losses, strict=True)
                       if e.seq not in released and _guard_kind(e) == kind]  # fmt: skip
            reasons = guard.check([loss for _, loss in checked])
            suspects += [(e, loss, reason) for (e, loss), reason in zip(checked, reasons, strict=True) if reason]
        if not suspects:
            return False
        self.trainer.optimizer.zero_grad(set_to_none=True)
        for entry, loss, reason in suspects:
            logger.warning("feedback %d (response %s) quarantined: %s", entry.seq, entry.response_id, reason)
            self.quarantine.hold(entry, reason, loss)
            self.stats.quarantined += 1
        held = {e.seq for e, _, _ in suspects}
        self._batch[:0] = [e for e in batch if e.seq not in held]
        return True

    def _count(self, group: list[Sample], results: list[tuple[float, bool]]) -> None:
        """A group of the batch's samples (and anchors) is trained: into the counters, at once (/metrics reads them
        while the batch goes on)."""
        used = self.trainer.stats.staleness_used  # this trainer's replayed records, by versions behind
        self.stats.staleness_sum = sum(lag * count for lag, count in used.items())
        for sample, (_, replayed) in zip(group, results, strict=True):
            if sample.targets is not None:  # an anchor
                self.stats.anchor_samples += 1
                self.stats.anchor_tokens += len(sample.response_ids)
                self.stats.anchor_replayed += replayed
            else:
                self.stats.samples += 1
                self.stats.response_tokens += len(sample.response_ids)
                self.stats.replayed += replayed
                self.stats.recomputed += not replayed

    def _anchor_samples(self) -> Generator[None, None, list[Sample]]:
        """The batch's anchors: the most recent served completions (their responses' first ``anchor_max_tokens``),
        each with the base model's top-k distribution there (computed once per anchor, ``group_size`` anchors per
        forward, a slice per layer)."""
        if not self.config.anchor_weight:
            return []
        c = self.config
        recent = self.anchors.recent(c.anchor_samples)
        anchors = [(anchor, anchor.response_ids[: c.anchor_max_tokens]) for anchor in recent]
        new = [(anchor, response) for anchor, response in anchors if anchor.targets is None]
        for start in range(0, len(new), c.group_size):
            group = new[start : start + c.group_size]
            pairs = [(a.prompt_ids, r) for a, r in group]
            targets = yield from references_slices(self.engine.model, pairs, c.anchor_top_k)
            for (anchor, _), anchor_targets in zip(group, targets, strict=True):
                anchor.targets = anchor_targets
            yield
        return [Sample(a.prompt_ids, response, a.response_id, a.targets) for a, response in anchors]

    # --- rollback (any thread) -----------------------------------------------------------------------------------

    def rollback(self, version: int) -> int:
        """Serve ``version`` again (0: the base model), as a new version; returns the new version's number.

        A batch in training is finished first (published and checkpointed, so its feedback counts as trained and
        its version stays a rollback target), and no new one starts meanwhile: dropping it instead would lose its
        work, and rollbacks quicker than a batch would stop training altogether. So this may wait a batch's time."""
        kept = lambda: version == 0 or version in {v.version for v in self.checkpoints.versions()}
        with self._idle:
            if not kept():
                raise KeyError(version)
            self._rollbacks_waiting += 1
            try:
                self._idle.wait_for(lambda: self._job is None)  # the step loop runs the batch's slices meanwhile
            finally:
                self._rollbacks_waiting -= 1
            if not kept():  # the batch's checkpoint pushed it out (keep_versions)
                raise KeyError(version)
            self._batch.clear()  # entries read ahead, not trained: read again from the position, after the swap
            self._read_position = self.position
            if version == 0:
                self._load_initial()
            else:
                self._load(version)
            self.adapter.version = max([self.version, *(v.version for v in self.checkpoints.versions())]) + 1
            self.engine.set_adapter(self.adapter, self.version)
            self.checkpoints.save(
                self.version, self.adapter, self.trainer.optimizer.state_dict(), self.position, {"rollback_of": version}
            )
            return self.version
