"""The online trainer: the feedback log becomes LoRA updates that the engine serves minutes later.

    trainer = OnlineTrainer(model, tokenizer, engine, store, log, AdapterCheckpoints(dir, keep), OnlineConfig())
    while serving:                       # the stepping thread (alchemist.server.async_engine, time_share)
        engine.step()
        if trainer.has_work(): trainer.run_slice()

The story of one mini-batch: the next queued entries of the log, corrections first, oldest first
(``alchemist.training.feedback_queue``, which also skips what the backlog policy gives up on) -> a
``FeedbackBatch``: corrections by SFT, ratings by KTO, preference pairs by DPO, against the base model's
log-probabilities, computed once (``alchemist.training.objectives``) -> ``epochs`` optimizer steps, each sample
replayed from its record where the record is fresh enough, recomputed otherwise -> publish the new adapter version
(to an ``AdapterPublisher``: the engine, which training knows only by that Protocol, ``alchemist.training.seams``)
-> checkpoint it (adapter, optimizer state, the log position up to which everything is settled, its
metrics and the seqs it trained) atomically -> mark the entries trained in the log. Before the first update, the
poisoning guard (``alchemist.training.quarantine``) looks at each sample's loss: an entry whose loss is NaN/inf or
a spike is quarantined (a state in the log), the gradients are dropped, and the rest of the batch, still queued,
trains next without it. Each step also keeps the
adapted model close to the base model on recent served traffic: ``anchor_weight`` x KL(base || adapted) over
``anchor_samples`` anchors (``alchemist.training.anchors``; replayed from their records too).

Exactly once: an entry is queued in the log until its batch's checkpoint is committed. A crash before it loses the
batch's update, and the restarted trainer reads the same entries again (still queued); a crash between the
checkpoint and the log's update is settled by ``restore`` from the checkpoint's seqs. Acknowledged feedback is in
the log before the server answers, so none is lost.

Slices: all work is done in small slices (half a layer of a replay walk, a layer of the anchors' reference forward or of
a publish's merge, a sample's loss, a recomputed group of samples trained together, an update, a checkpoint) from the
thread that steps the engine, between its steps: serving waits for the slice in progress, so none may be long (groups
are capped in rows: ``group_max_tokens``). Training never runs concurrently with serving: on this CPU that slowed decode
steps severalfold (docs/benchmarks.md, "Training beside a step"). ``train_share`` bounds training's share of time while
requests are in flight (the step loop's accounting); with none in flight, training takes what is free.

Rollback serves an earlier version again, as a new version (numbers only grow, so records' staleness stays
meaningful): the adapter and optimizer state of the earlier version become the trainer's, the log position stays
(feedback trained since is not trained again). Any thread asks for one (``rollback`` returns a future); the thread
that runs the slices does it, like all of training's torch work, once the batch in training is published and
checkpointed, and no new batch starts meanwhile, so a rollback never throws training away.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Generator
from concurrent.futures import Future
from functools import partial

from alchemist.config import OnlineConfig
from alchemist.feedback.log import FeedbackEntry, FeedbackLog
from alchemist.model.llama import Llama
from alchemist.model.lora import LoraAdapter, LoraConfig
from alchemist.model.tokenizer import Tokenizer
from alchemist.training.anchors import Anchor, AnchorPool, known_fact_anchors, references_slices
from alchemist.training.checkpoint import AdapterCheckpoints
from alchemist.training.evaluation import Evaluation, EvaluationGate, GateBounds, Pair
from alchemist.training.feedback_batch import FeedbackBatch, Item, ObjectiveWeights
from alchemist.training.feedback_queue import FeedbackQueue
from alchemist.training.losses import least_token_logp
from alchemist.training.protected import ProtectedSubspace
from alchemist.training.quarantine import PoisoningGuard, Quarantine
from alchemist.training.rank_split import RankSplit, widen
from alchemist.training.recompute import response_values_slices
from alchemist.training.regression import RegressionBounds, find_regression, ratings_by_version
from alchemist.training.seams import AdapterPublisher, RecordSource
from alchemist.training.slices import run_to_end
from alchemist.training.taught import taught_corrections
from alchemist.training.trainer import Sample, StepResult, Trainer

logger = logging.getLogger(__name__)


def taught_prompts(log: FeedbackLog, version: int, undone: list[list[int]]) -> list[list[int]]:
    """The prompts of the corrections adapter ``version``'s weights hold (trained by it or an earlier version, none
    undone by a rollback: ``undone``, its checkpoint's): the requests like them are served the corrections' ranks
    (alchemist.engine.router). From the log, so a restart or a rollback knows them."""
    entries = taught_corrections(log, 1 << 62, undone)
    return [e.prompt_token_ids for e in entries if e.trained_version is not None and e.trained_version <= version]


def as_trained(adapter: LoraAdapter, config: OnlineConfig, log: FeedbackLog, version: int, undone: list[list[int]]):
    """A checkpoint's ``adapter`` as the online trainer of ``config`` made it, to serve without that trainer: its
    corrections' ranks cut and routed to the prompts they were taught on, where ``config`` cuts them."""
    if config.preference_r and config.route_corrections and adapter.config.r == adapter_config(config).r:
        RankSplit(adapter, config.preference_r, cut=True)
        adapter.taught = taught_prompts(log, version, undone)
    return adapter


def adapter_config(config: OnlineConfig) -> LoraConfig:
    """The adapter's: ``lora_r`` ranks plus ``preference_r`` ranks only thumbs and pairs train, scaled as
    ``lora_r`` ranks alone would be (alpha / r = lora_alpha / lora_r)."""
    r = config.lora_r + config.preference_r
    return LoraConfig(r=r, alpha=config.lora_alpha * r / config.lora_r)


class OnlineTrainer:
    def __init__(
        self,
        model: Llama,
        tokenizer: Tokenizer,
        publisher: AdapterPublisher,
        store: RecordSource | None,
        log: FeedbackLog,
        checkpoints: AdapterCheckpoints,
        config: OnlineConfig,
    ) -> None:
        """Trains an adapter of ``model`` (the one serving, shared: never changed here) from ``log``, replays
        records from ``store`` (None: none) and publishes the versions it makes to ``publisher``."""
        self.model, self.tokenizer = model, tokenizer
        self.publisher = publisher
        self.log = log
        self.checkpoints = checkpoints
        self.config = config
        self.adapter = LoraAdapter(model.config, adapter_config(config), device=model.device, seed=config.seed)
        self.trainer = Trainer(model, self.adapter, store, config.trainer)
        if config.preference_r:  # its last ranks only thumbs and pairs train (alchemist.training.rank_split)
            self.trainer.split = RankSplit(self.adapter, config.preference_r, cut=config.route_corrections)
        self.anchors = AnchorPool(config.anchor_pool_size)  # the server offers finished completions
        self.known_facts = known_fact_anchors(tokenizer) if config.anchor_known_facts else []
        self._known_next = 0  # the next known fact to anchor on (they are taken in turn, batch by batch)
        self._rehearsed_through = 0  # rehearsal takes trained corrections in turn: the last one's seq
        # Versions a rollback undid, as [lo, hi] ranges (lo < version <= hi): what they trained is not rehearsed.
        # Every checkpoint carries the ranges its weights stand for ("undone"), so a restart or a later rollback
        # to it knows them.
        self._undone: list[list[int]] = []
        self.weights = ObjectiveWeights(
            sft=config.sft_weight, kto=config.kto_weight, dpo=config.dpo_weight, kto_beta=config.kto_beta,
            dpo_beta=config.dpo_beta, desirable=config.kto_desirable_weight, undesirable=config.kto_undesirable_weight,
        )  # fmt: skip
        # Feedback on a prompt: neither the response nor its prompt is an anchor any more.
        self.queue = FeedbackQueue(log, config, lambda e: self.anchors.exclude(e.response_id, e.prompt_token_ids))
        self.stats = self.trainer.stats  # one set of counters: the trainer's passes, this loop's batches
        self.stats.skipped = self.queue.skipped
        self.quarantine = Quarantine(log, on_release=self.queue.changed)
        self.guard = PoisoningGuard(config.loss_spike_factor, config.loss_spike_warmup)
        self.regression = RegressionBounds(config.rollback_min_ratings, config.rollback_margin, config.rollback_z)
        self.gate = None
        if config.gate and config.enabled:
            bounds = GateBounds(config.gate_heldout_max_rise, config.gate_canary_max_drop,
                                config.gate_canary_max_mean_drop, config.gate_taught_max_rise,
                                config.gate_taught_samples)  # fmt: skip
            try:
                self.gate = EvaluationGate(model, tokenizer, bounds, config.trainer.group_size)
            except ValueError as e:  # a tokenizer without a chat template: nothing to ask the canaries with
                logger.warning("no evaluation gate (%s): new adapter versions serve unevaluated", e)
        self._gate_s = 0.0  # the gate's seconds when the batch in progress began
        self.position = 0  # every log entry up to this seq is settled (trained, skipped, held) as of the checkpoint
        self._job: Generator[None, None, None] | None = None
        self._job_s = 0.0  # time spent in the slices of the batch in progress
        # Rollbacks asked for (any thread), done by run_slice at the next batch boundary; no batch starts meanwhile.
        self._rollbacks: list[tuple[int, Future[int]]] = []
        self._rollbacks_lock = threading.Lock()
        self.restore()

    # --- state ---------------------------------------------------------------------------------------------------

    def restore(self) -> None:
        """Continue from the latest checkpoint (if any): its adapter served, its optimizer state, its position."""
        latest = self.checkpoints.latest()
        if latest is None:
            return
        served = self._load_serving()
        self.adapter.version = latest.version
        self.position = self.queue.seen = latest.log_position
        if served:
            self.publisher.set_adapter(self.adapter, served)
        self._settle_checkpointed()
        logger.info("online trainer: resumed serving adapter version %d (newest %d), log position %d", served,
                    latest.version, self.position)  # fmt: skip

    def _settle_checkpointed(self) -> None:
        """The log's states catch up with the checkpoints: the entries a kept version trained (the log is told
        right after each checkpoint; a crash in between leaves them queued), then the queued ones before the
        position, which only a log from before states were kept has (its trainer trained "sft" entries and passed
        the other kinds over)."""
        for info in self.checkpoints.versions():
            if info.promoted:
                self.log.mark_trained(info.metrics.get("seqs", []), info.version)
            else:
                for entry in filter(None, map(self.log.get, info.metrics.get("seqs", []))):
                    reason = _unpromoted(info.version, info.metrics["evaluation"]["reason"])
                    self.quarantine.hold(entry, reason, info.metrics.get("loss", float("nan")))
        passed = self.log.queued_seqs(through_seq=self.position)
        self.log.mark_trained([seq for seq, kind in passed if kind == "sft"], None)
        for kind in {kind for _, kind in passed if kind != "sft"}:
            seqs = [seq for seq, k in passed if k == kind]
            self.log.mark_skipped(seqs, f"logged before the trainer trained {kind!r} feedback")

    def _load_serving(self) -> int:
        """The trainer's adapter and optimizer state become the newest promoted version's (the one that serves: a
        version the evaluation gate kept from serving is not trained on); returns its number (0: the base model)."""
        serving = self.checkpoints.serving()
        if serving is None:
            self._load_initial()
            return 0
        self._load(serving.version)
        return serving.version

    def _load(self, version: int) -> None:
        model = self.model
        adapter, optimizer_state, _ = self.checkpoints.load(version, model.config, model.device)
        info = next(v for v in self.checkpoints.versions() if v.version == version)
        self._undone = [list(r) for r in info.metrics.get("undone", [])]
        if self.trainer.split is not None and adapter.config.r == self.config.lora_r:  # saved before the split
            initial = LoraAdapter(self.adapter.model_config, self.adapter.config, seed=self.config.seed)
            adapter, optimizer_state = initial, widen(adapter, initial, optimizer_state)
        if adapter.config.r != self.adapter.config.r or adapter.config.alpha != self.adapter.config.alpha:
            raise ValueError(
                f"adapter version {version} has r={adapter.config.r}, alpha={adapter.config.alpha}; this trainer is "
                f"configured with lora_r={self.config.lora_r}, preference_r={self.config.preference_r}, "
                f"lora_alpha={self.config.lora_alpha} (r={self.adapter.config.r}, alpha={self.adapter.config.alpha})"
            )
        self.adapter.load_state_dict(adapter.state_dict())
        self.trainer.optimizer.load_state_dict(optimizer_state)
        self.adapter.taught = self._taught_prompts(version)

    def _taught_prompts(self, version: int) -> list[list[int]]:
        return taught_prompts(self.log, version, self._undone) if self.adapter.cut else []

    @property
    def version(self) -> int:
        return self.adapter.version

    @property
    def protected(self) -> ProtectedSubspace | None:
        """The directions every update keeps out of the adapter (computed before the first step; protect_energy)."""
        return self.trainer.protected

    # --- the step loop's interface -------------------------------------------------------------------------------

    def has_work(self) -> bool:
        if self._job is not None or self._rollbacks:
            return True
        if not self.config.enabled:
            return False
        head = self.queue.head()
        if not head:
            return False
        waited_s = time.time() - min(entry.created_s for entry, _ in head)
        return len(head) >= self.config.batch_size or waited_s >= self.config.max_wait_s

    def run_slice(self) -> float:
        """One slice of training work, or a rollback asked for; returns the seconds it took. Call it from the
        thread that steps the engine, between its steps."""
        t0 = time.perf_counter()
        if self._job is None and self._rollbacks:
            self._roll_back_next()
            return time.perf_counter() - t0  # serving's time share counts it; training's seconds do not
        if not self.has_work():
            return 0.0
        if self._job is None:
            self._watch()
            self._job = self._train_slices(self.queue.head())
        try:
            next(self._job)
        except StopIteration:
            self._job = None
        except Exception:
            # Nothing acknowledged is lost: the batch's entries are still queued in the log, read again later.
            logger.exception("online training failed; its batch will be read again")
            self._abandon()
        elapsed = time.perf_counter() - t0
        self.stats.train_s += elapsed
        self._job_s += elapsed
        return elapsed

    def _abandon(self) -> None:
        """Drop the batch in progress: back to the latest checkpoint's adapter and optimizer state (epochs already
        applied must not count), and read the log again from its position."""
        self._job = None
        self.queue.changed()
        self.trainer.optimizer.zero_grad(set_to_none=True)
        latest = self.checkpoints.latest()
        self._load_serving()
        self.adapter.version = 0 if latest is None else latest.version

    def _load_initial(self) -> None:
        """The adapter as it starts (B = 0: it serves exactly the base model's outputs), a fresh optimizer."""
        initial = LoraAdapter(self.adapter.model_config, self.adapter.config, seed=self.config.seed)
        self.adapter.load_state_dict(initial.state_dict())
        self.trainer.optimizer.state.clear()
        self._undone = []
        self.adapter.taught = []

    # --- one mini-batch ------------------------------------------------------------------------------------------

    def _train_slices(self, batch: list[tuple[FeedbackEntry, Item]]) -> Generator[None, None, None]:
        """One mini-batch, in slices: the story of this module's docstring."""
        # A record is keyed by its response id; any policy may have made one (not only a request's flag): look.
        feedback = FeedbackBatch([it for _, it in batch], self.weights, self.config.trainer.group_size)
        anchors = yield from self._prepare_slices(feedback)
        self._job_s = 0.0
        facts, taught_before = yield from self._taught_slices()
        rehearsed = self._rehearsal()
        # A rehearsed correction weighs what one of the batch's own does; the anchors share anchor_weight.
        rehearsed_scales = [self.config.sft_weight / max(len(feedback.sft), len(rehearsed), 1)] * len(rehearsed)
        anchor_scales = [self.config.anchor_weight / len(anchors)] * len(anchors) if anchors else []
        extra, extra_scales = rehearsed + anchors, rehearsed_scales + anchor_scales
        steps: list[tuple[list[Sample], StepResult]] = []
        yielded = False  # the steps ended early for corrections waiting behind the batch
        for epoch in range(self.config.epochs):
            samples, scales = yield from feedback.samples_slices(self.trainer)  # z0 under this adapter
            screen = partial(self._screen, batch, feedback, len(samples)) if epoch == 0 else None
            # each sample's record or a recompute -> loss -> backward -> update
            step = yield from self.trainer.step_slices(samples + extra, scales + extra_scales, screen)
            if not step.updated:
                return  # suspects quarantined, no update: the rest of the batch, still queued, trains next without them
            steps.append((samples, step))
            if epoch + 1 == self.config.epochs:
                break
            if self._reached_target(samples, step.passes) and (yield from self._learned_slices(samples)):
                break
            if self._yields(batch):
                yielded = True
                break
        metrics = {**self._batch_metrics(feedback, rehearsed, anchors, steps), "yielded": yielded}
        evaluation = yield from self._evaluate_slices(facts, taught_before)
        if evaluation is None or evaluation.promoted:
            # the batch's corrections are taught now: the requests like them get the corrections' ranks
            if self.adapter.cut:
                self.adapter.taught = [*self.adapter.taught, *(e.prompt_token_ids for e, _ in batch if e.correction)]
            yield from self.publisher.set_adapter_slices(self.adapter, self.version)  # merged here, a layer per slice
            yield
        yield from self._commit_slices(batch, metrics, evaluation)

    def _prepare_slices(self, feedback: FeedbackBatch) -> Generator[None, None, list[Sample]]:
        """What every step of the batch uses, computed once: the base model's log-probabilities of the preference
        responses, the anchors with their targets, the protected directions; returns the anchors."""
        if feedback.kto or feedback.dpo:
            yield from feedback.references_slices(self.trainer)  # the base model's, once for all epochs
        anchors = yield from self._anchors_slices()
        if self.config.protect_energy and self.trainer.protected is None:
            self.trainer.protected = yield from ProtectedSubspace.load_or_compute_slices(
                self.model, self.tokenizer, self.adapter, self.config.protect_energy
            )
            logger.info("protected directions: %s", self.trainer.protected.describe())
        if self.trainer.protected is not None:  # also an adapter just reset, restored or rolled back to (idempotent)
            self.trainer.protected.project_(self.adapter, self.trainer.split)
        return anchors

    def _taught_slices(self) -> Generator[None, None, tuple[list[Pair], list[float]]]:
        """The evaluation gate's facts taught earlier and their losses on the serving state (this batch's start)."""
        if self.gate is None:
            return [], []
        self._gate_s = self.gate.seconds
        facts = [(e.prompt_token_ids, e.response_token_ids) for e in taught_corrections(
            self.log, self.gate.bounds.taught_samples, self._undone, newest_first=True)]  # fmt: skip
        taught_before = yield from self.gate.taught_slices(self.adapter, facts)
        return facts, taught_before

    def _evaluate_slices(
        self, facts: list[Pair], taught_before: list[float]
    ) -> Generator[None, None, Evaluation | None]:
        """The evaluation gate's verdict on the trained adapter (None: no gate)."""
        if self.gate is None:
            return None
        evaluation = yield from self.gate.evaluate_slices(self.adapter, facts, taught_before)
        evaluation.seconds = self.gate.seconds - self._gate_s  # its start-of-batch part too
        self.stats.evaluation_s = self.gate.seconds
        return evaluation

    def _batch_metrics(
        self,
        feedback: FeedbackBatch,
        rehearsed: list[Sample],
        anchors: list[Sample],
        steps: list[tuple[list[Sample], StepResult]],
    ) -> dict:
        """The batch's steps summed up for its checkpoint (and the last ones for /metrics)."""
        losses = [sum(loss for loss, _ in step.passes[: len(samples)]) / len(samples) for samples, step in steps]
        first, last = steps[0], steps[-1]
        rehearsal = [[loss for loss, _ in step.passes[len(samples) : len(samples) + len(rehearsed)]]
                     for samples, step in (first, last)]  # fmt: skip
        kls = [sum(loss for loss, _ in step.passes[len(samples) + len(rehearsed) :]) / max(len(anchors), 1)
               for samples, step in steps]  # fmt: skip
        tokens = sum(len(s.response_ids) for samples, _ in steps for s in samples)
        self.stats.last_loss = losses[-1]
        self.stats.last_anchor_kl = kls[-1] if anchors else None
        # The batch's own time: its slices (serving steps ran in between), all but this last short one.
        self.stats.last_tokens_per_s = tokens / self._job_s if self._job_s > 0 else 0.0
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

    def _commit_slices(
        self, batch: list[tuple[FeedbackEntry, Item]], metrics: dict, evaluation: Evaluation | None
    ) -> Generator[None, None, None]:
        """Checkpoints the batch's version, then tells the log: its entries trained (promoted) or held (not)."""
        seqs = [entry.seq for entry, _ in batch]
        metrics = {**metrics, "seqs": seqs, "train_s": self._job_s}  # the batch's slices, the evaluation's included
        if self._undone:
            metrics["undone"] = self._undone
        if evaluation is not None:
            metrics["evaluation"] = evaluation.as_dict()
        state = self.trainer.optimizer.state_dict()
        position = self.log.settled_through(excluding=seqs)
        yield from self.checkpoints.save_slices(self.version, self.adapter, state, position, metrics)
        self.position = position
        if evaluation is None or evaluation.promoted:
            self.log.mark_trained(seqs, self.version)  # after the commit: restore() redoes it if lost
        else:  # kept, a rollback target, but not served nor trained on: its entries are held for an admin
            logger.warning("adapter version %d not promoted: %s", self.version, evaluation.reason)
            self.stats.unpromoted += 1
            for entry, _ in batch:
                reason = _unpromoted(self.version, evaluation.reason)
                self.stats.quarantined += self.quarantine.hold(entry, reason, metrics["loss"])
            self._load_serving()  # the trainer goes on from the serving version (its number stays: numbers grow)
        self.queue.changed()

    def _screen(
        self,
        batch: list[tuple[FeedbackEntry, Item]],
        feedback: FeedbackBatch,
        num_samples: int,
        passes: list[tuple[float, bool]],
    ) -> bool:
        """The first step's veto: quarantines the entries whose samples' losses the guard flags; False if any (the
        step then drops its gradients)."""
        entries = {entry.seq: entry for entry, _ in batch}
        losses = [loss for loss, _ in passes[:num_samples]]
        samples = [(entries[it.seq], it, loss) for it, loss in zip(feedback.sample_items(), losses, strict=True)]
        suspects = self.guard.suspects(samples)
        if not suspects:
            return True
        for seq, (reason, loss) in suspects.items():
            logger.warning("feedback %d (response %s) quarantined: %s", seq, entries[seq].response_id, reason)
            self.stats.quarantined += self.quarantine.hold(entries[seq], reason, loss)
        self.queue.changed()
        return False

    def _reached_target(self, samples: list[Sample], results: list[tuple[float, bool]]) -> bool:
        """Whether the batch's steps may end here: every correction's loss in this step (before its update) was
        under ``target_loss`` (with no target, never: all ``epochs`` steps run)."""
        target = self.config.target_loss
        return bool(target) and all(loss < target for s, (loss, _) in zip(samples, results, strict=False)
                                    if s.term is None)  # fmt: skip

    def _learned_slices(self, samples: list[Sample]) -> Generator[None, None, bool]:
        """Whether the adapter as updated now says each of the batch's corrections (and thumbs-up answers) itself:
        every token likelier than ``target_token_p`` given those before it, a pass without gradient over them
        (``target_token_p`` 0: true). Asked once their mean losses are under ``target_loss``, which a correction
        with a wrong name or year left passed the same."""
        p = self.config.target_token_p
        sft = [(s.prompt_ids, s.response_ids) for s in samples if s.term is None]
        if not p or not sft:
            return True
        model = self.trainer.model
        least = yield from response_values_slices(model, self.adapter, sft, partial(least_token_logp, model),
                                                  self.config.trainer.group_size)  # fmt: skip
        self.stats.learned_checks += 1
        return min(least) > math.log(p)

    def _yields(self, batch: list[tuple[FeedbackEntry, Item]]) -> bool:
        """Whether the batch's further steps yield to the backlog: a correction queued behind it has waited
        ``yield_after_s`` (the batch's own entries are still queued too: not counted)."""
        after_s = self.config.yield_after_s
        if not after_s:
            return False
        oldest = self.log.oldest_queued("correction", excluding=[entry.seq for entry, _ in batch])
        return oldest is not None and time.time() - oldest >= after_s

    def _anchors_slices(self) -> Generator[None, None, list[Sample]]:
        """The batch's anchors: the most recent served completions (their responses' first ``anchor_max_tokens``;
        ``anchor_max_rows`` rows at most together) and the next known facts, each with the base model's top-k
        distribution there (computed once per anchor, ``group_size`` anchors per forward, a slice per layer)."""
        if not self.config.anchor_weight:
            return []
        c = self.config
        served = self.anchors.recent(c.anchor_samples, c.anchor_max_rows or math.inf, c.anchor_max_tokens)
        recent = served + self._next_known_facts()
        anchors = [(anchor, anchor.response_ids[: c.anchor_max_tokens]) for anchor in recent]
        new = [(anchor, response) for anchor, response in anchors if anchor.targets is None]
        for start in range(0, len(new), c.trainer.group_size):
            group = new[start : start + c.trainer.group_size]
            pairs = [(a.prompt_ids, r) for a, r in group]
            targets = yield from references_slices(self.model, pairs, c.anchor_top_k)
            for (anchor, _), anchor_targets in zip(group, targets, strict=True):
                anchor.targets = anchor_targets
            yield
        return [Sample(a.prompt_ids, response, a.response_id, a.targets) for a, response in anchors]

    def _rehearsal(self) -> list[Sample]:
        """The batch's corrections trained before: the next ones of the log, in turn (starting over after the
        last), ``rehearse_corrections`` at most and ``rehearse_max_tokens`` rows at most (one longer than that alone
        is passed over), none that a version a rollback undid trained; replayed from their records while those are
        fresh."""
        count, budget = self.config.rehearse_corrections, self.config.rehearse_max_tokens or math.inf
        if not count:
            return []
        entries = taught_corrections(self.log, count, self._undone, self._rehearsed_through)
        if len(entries) < count:  # the end of the log: start over from the oldest (never one twice in a batch)
            seen = {e.seq for e in entries}
            again = taught_corrections(self.log, count - len(entries), self._undone)
            entries += [e for e in again if e.seq not in seen]
        taken, rows = [], 0
        for entry in entries:
            size = len(entry.prompt_token_ids) + len(entry.response_token_ids) - 1
            if size > budget:
                self._rehearsed_through = entry.seq  # never fits: passed over
                continue
            if rows + size > budget:
                break  # first in line next time
            taken.append(entry)
            rows += size
            self._rehearsed_through = entry.seq
        return [Sample(e.prompt_token_ids, e.response_token_ids, e.response_id) for e in taken]

    def _next_known_facts(self) -> list[Anchor]:
        """The batch's ``anchor_known_facts`` known facts: the next ones of the list, in turn."""
        count = min(self.config.anchor_known_facts, len(self.known_facts))
        start, self._known_next = self._known_next, (self._known_next + count) % max(len(self.known_facts), 1)
        return [self.known_facts[(start + i) % len(self.known_facts)] for i in range(count)]

    # --- rollback ----------------------------------------------------------------------------------------------

    def rollback(self, version: int) -> Future[int]:
        """Asks to serve ``version`` again (0: the base model), as a new version; any thread. The future gives the
        new version's number once ``run_slice`` has made it (KeyError: ``version`` is not kept); KeyError here
        already if it is not kept now.

        A batch in training is finished first (published and checkpointed, so its feedback counts as trained and
        its version stays a rollback target), and no new one starts meanwhile: dropping it instead would lose its
        work, and rollbacks quicker than a batch would stop training altogether. So this may wait a batch's time."""
        if not self._kept(version):
            raise KeyError(version)
        done: Future[int] = Future()
        with self._rollbacks_lock:
            self._rollbacks.append((version, done))
        return done

    def _kept(self, version: int) -> bool:
        return version == 0 or version in {v.version for v in self.checkpoints.versions()}

    def _roll_back_next(self) -> None:
        """The oldest rollback asked for, in the slices' thread, between batches."""
        with self._rollbacks_lock:
            version, done = self._rollbacks.pop(0)
        if not done.set_running_or_notify_cancel():
            return
        try:
            if not self._kept(version):  # the last batch's checkpoint pushed it out (keep_versions)
                raise KeyError(version)
            self._serve_again(version, {"rollback_of": version})
        except Exception as e:  # the asker learns it (a 404, a 500); training goes on
            done.set_exception(e)
        else:
            done.set_result(self.version)

    def _serve_again(self, version: int, metrics: dict) -> int:
        """Between batches: ``version``'s weights (0: the base model's) become a new version that serves."""
        self.queue.changed()
        newest = max([self.version, *(v.version for v in self.checkpoints.versions())])
        if version == 0:
            self._load_initial()
        else:
            self._load(version)
        if version < newest:  # what the versions after it trained is not rehearsed again
            self._undone.append([version, newest])
        metrics = {**metrics, **({"undone": self._undone} if self._undone else {})}
        self.adapter.version = newest + 1
        self.publisher.set_adapter(self.adapter, self.version)
        state = self.trainer.optimizer.state_dict()
        run_to_end(self.checkpoints.save_slices(self.version, self.adapter, state, self.position, metrics))
        return self.version

    def _watch(self) -> None:
        """Between batches: serving goes back past versions its users rate clearly worse than those before them
        (``alchemist.training.regression``)."""
        if self.regression.min_ratings <= 0:
            return
        per_key = max(1, math.ceil(self.config.key_share * self.regression.min_ratings))
        found = find_regression(self._lineage(), ratings_by_version(self.log.ratings(), per_key), self.regression)
        if found is None or not self._kept(found.target):
            return
        version = self._serve_again(found.target, {"rollback_of": found.target, "regression": found.reason})
        logger.warning("adapter version %d serves version %d again: %s", version, found.target, found.reason)

    def _lineage(self) -> list[int]:
        """The versions served one after another since the last rollback (or since the base model, while every
        version since it is kept), oldest first."""
        kept = self.checkpoints.versions()
        served = [v for v in kept if v.promoted]
        last = max((i for i, v in enumerate(served) if "rollback_of" in v.metrics), default=None)
        if last is not None:
            return [v.version for v in served[last:]]
        base = [0] if kept and kept[0].version == 1 else []
        return base + [v.version for v in served]


def _unpromoted(version: int, reason: str) -> str:
    return f"adapter version {version}, which trained it, was not promoted: {reason}"


def _mean_by_objective(samples: list[Sample], results: list[tuple[float, bool]]) -> dict[str, float]:
    """The mean loss of each objective's samples (a DPO pair's loss is on both of its samples)."""
    by: dict[str, list[float]] = {}
    for sample, (loss, _) in zip(samples, results, strict=False):  # results go on with the anchors
        by.setdefault("sft" if sample.term is None else sample.term.kind, []).append(loss)
    return {kind: sum(values) / len(values) for kind, values in by.items()}
