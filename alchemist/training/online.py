"""The online trainer: the feedback log becomes LoRA updates that the engine serves minutes later.

    trainer = OnlineTrainer.from_config(model, tokenizer, engine, store, log, AdapterCheckpoints(dir, keep),
                                        OnlineConfig())
    while serving:                       # the stepping thread (alchemist.runtime.async_engine, time_share)
        engine.step()
        if trainer.has_work(): trainer.run_slice()

The story of one mini-batch: the next queued entries of the log, corrections first, oldest first
(``alchemist.training.feedback_queue``, which also skips what the backlog policy gives up on) -> a
``FeedbackBatch``: corrections by SFT, ratings by KTO, preference pairs by DPO, against the base model's
log-probabilities, computed once (``alchemist.training.objectives``) -> ``stopping.epochs`` optimizer steps at most
(``alchemist.training.stopping``), each sample replayed from its record where the record is fresh enough,
recomputed otherwise -> publish the new adapter version (to an ``AdapterPublisher``: the engine, which training
knows only by that Protocol, ``alchemist.training.seams``) -> checkpoint it (adapter, optimizer state, the log
position up to which everything is settled, its metrics and the seqs it trained) atomically -> mark the entries
trained in the log (the last three: the adapter's lineage, ``alchemist.training.lineage``). A batch whose steps end
early for corrections waiting behind it leaves its own not learned yet queued: they go on in the next batch, beside
those, until they have had ``epochs`` steps (a batch that leaves all queued publishes nothing). Before the first
update, the poisoning guard (``alchemist.training.quarantine``) looks at each sample's loss: an entry whose loss is
NaN/inf or a spike is quarantined (a state in the log), the gradients are dropped, and the rest of the batch, still
queued, trains next without it. Each step also keeps the adapted model close to the base model on recent served
traffic: ``anchors.weight`` x KL(base || adapted) over the batch's anchors, every ``anchors.turn``-th of them in
each step (``alchemist.training.anchors``; replayed from their records too), and rehearses corrections trained
before (``alchemist.training.rehearsal``).

Exactly once: an entry is queued in the log until its batch's checkpoint is committed. A crash before it loses the
batch's update, and the restarted trainer reads the same entries again (still queued); a crash between the
checkpoint and the log's update is settled by ``restore`` from the checkpoint's seqs. Acknowledged feedback is in
the log before the server answers, so none is lost.

Slices: all work is done in small slices (half a layer of a replay walk, a layer of the anchors' reference forward or of
a publish's merge, a sample's loss, a recomputed group of samples trained together, an update, a checkpoint) from the
thread that steps the engine, between its steps: serving waits for the slice in progress, so none may be long (groups
are capped in rows: ``group_max_tokens``). Training never runs concurrently with serving: on this CPU that slowed decode
steps severalfold (docs/benchmarks.md, "Training beside a step"). While requests are in flight training gets what the
latency objective leaves between steps (the step loop's accounting: alchemist.runtime.time_share); with none in
flight, training takes what is free.

Rollback (``alchemist.training.lineage``) serves an earlier version again, as a new version (numbers only grow, so
records' staleness stays meaningful): the adapter and optimizer state of the earlier version become the trainer's,
the log position stays (feedback trained since is not trained again). Any thread asks for one (``rollback`` returns
a future); the thread that runs the slices does it, like all of training's torch work, once the batch in training
is published and checkpointed, and no new batch starts meanwhile, so a rollback never throws training away.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Generator
from concurrent.futures import Future
from functools import partial

from alchemist.config import OnlineConfig
from alchemist.feedback.log import FeedbackEntry, FeedbackLog
from alchemist.model.llama import Llama
from alchemist.model.lora import LoraAdapter
from alchemist.model.tokenizer import Tokenizer
from alchemist.training.anchors import AnchorPool, BatchAnchors, in_turn, known_fact_anchors
from alchemist.training.batch_metrics import batch_metrics
from alchemist.training.checkpoint import AdapterCheckpoints
from alchemist.training.evaluation import Evaluation, EvaluationGate, Pair
from alchemist.training.feedback_batch import FeedbackBatch, Item
from alchemist.training.feedback_queue import FeedbackQueue
from alchemist.training.lineage import Lineage, adapter_config
from alchemist.training.lockstep import Lockstep
from alchemist.training.protected import ProtectedSubspace
from alchemist.training.quarantine import PoisoningGuard, Quarantine
from alchemist.training.rank_split import RankSplit
from alchemist.training.regression import Regression
from alchemist.training.rehearsal import Rehearsal
from alchemist.training.seams import AdapterPublisher, RecordSource
from alchemist.training.stopping import Stopping
from alchemist.training.taught import taught_corrections
from alchemist.training.trainer import Sample, StepResult, Trainer

logger = logging.getLogger(__name__)


class OnlineTrainer:
    def __init__(
        self,
        config: OnlineConfig,
        tokenizer: Tokenizer,
        log: FeedbackLog,
        trainer: Trainer,
        queue: FeedbackQueue,
        lineage: Lineage,
        anchors: BatchAnchors,
        rehearsal: Rehearsal,
        stopping: Stopping,
        quarantine: Quarantine,
        guard: PoisoningGuard,
        gate: EvaluationGate | None,
        lockstep: Lockstep | None = None,
    ) -> None:
        """The loop over its parts (``from_config`` wires them as the server does): ``trainer`` steps the adapter,
        which ``lineage`` restores, publishes, checkpoints and rolls back; ``queue`` reads ``log`` in training order;
        ``gate`` None: no evaluation gate; ``lockstep``: one replica of several, each training on its own feedback
        in data-parallel steps with the others (``alchemist.training.lockstep``; its trainer's data_parallel is
        lockstep's). Nothing is restored here (``from_config`` does it)."""
        self.config, self.tokenizer, self.log = config, tokenizer, log
        self.trainer, self.model, self.adapter = trainer, trainer.model, trainer.adapter
        self.queue, self.lineage, self.batch_anchors, self.rehearsal = queue, lineage, anchors, rehearsal
        self.stopping, self.quarantine, self.guard, self.gate = stopping, quarantine, guard, gate
        self.checkpoints = lineage.checkpoints
        self.stats = trainer.stats  # one set of counters: the trainer's passes, this loop's batches
        self._gate_s = 0.0  # the gate's seconds when the batch in progress began
        self._job: Generator[None, None, None] | None = None
        self._job_s = 0.0  # time spent in the slices of the batch in progress
        self._steps_of: dict[int, int] = {}  # steps each correction carried over from a batch has had (by seq)
        self.lockstep = lockstep

    @classmethod
    def from_config(
        cls,
        model: Llama,
        tokenizer: Tokenizer,
        publisher: AdapterPublisher,
        store: RecordSource | None,
        log: FeedbackLog,
        checkpoints: AdapterCheckpoints,
        config: OnlineConfig,
        lockstep: Lockstep | None = None,
        initial: LoraAdapter | None = None,
    ) -> OnlineTrainer:
        """Trains an adapter of ``model`` (the one serving, shared: never changed here) from ``log``, replays
        records from ``store`` (None: none) and publishes the versions it makes to ``publisher``; continues from
        the latest of ``checkpoints``; with ``lockstep``, in lockstep with the other replicas. Each part is built
        from its section of ``config``. ``initial``: the adapter to start from, with its own rank and targets (a
        named adapter as loaded: ``alchemist.runtime.trainers``; no preference ranks are split off it; the anchors and
        the evaluation gate hold the trained adapter close to it rather than to the base model; KTO's and DPO's
        reference stays the base model), else a fresh one of ``config.adapter``."""
        c = config
        lora = adapter_config(c.adapter) if initial is None else initial.config
        adapter = LoraAdapter(model.config, lora, device=model.device, seed=c.adapter.seed)
        trainer = Trainer(model, adapter, store, c.trainer, lockstep.data_parallel if lockstep else None)
        if c.adapter.preference_r and initial is None:  # its last ranks only thumbs and pairs train (rank_split)
            trainer.split = RankSplit(adapter, c.adapter.preference_r, cut=c.adapter.route_corrections)
        if initial is not None:  # the protected directions are kept out of what it learns, not out of what it was
            trainer.origin = {key: a.detach().to(adapter.A[key]).clone() for key, a in initial.A.items()}
        pool = AnchorPool(c.anchors.pool_size)  # the server offers finished completions
        facts = known_fact_anchors(tokenizer) if c.anchors.known_facts else []
        anchors = BatchAnchors(model, pool, facts, c.anchors, c.trainer.group_size, initial)
        # Feedback on a prompt: neither the response nor its prompt is an anchor any more.
        queue = FeedbackQueue(log, c.queue, c.objectives.thumbs_up,
                              lambda e: pool.exclude(e.response_id, e.prompt_token_ids))  # fmt: skip
        trainer.stats.skipped = queue.skipped
        quarantine = Quarantine(log, on_release=queue.changed)
        lineage = Lineage(trainer, publisher, log, checkpoints, queue, quarantine, c.adapter, c.rollback,
                          c.queue.key_share, initial)  # fmt: skip
        gate = None
        if c.gate.enabled and c.enabled:
            try:
                gate = EvaluationGate(model, tokenizer, c.gate, c.trainer.group_size, initial)
            except ValueError as e:  # a tokenizer without a chat template: nothing to ask the canaries with
                logger.warning("no evaluation gate (%s): new adapter versions serve unevaluated", e)
        online = cls(c, tokenizer, log, trainer, queue, lineage, anchors, Rehearsal(log, c.rehearsal),
                     Stopping(c.stopping, log, trainer, c.trainer.group_size), quarantine,
                     PoisoningGuard(c.guard.spike_factor, c.guard.warmup), gate, lockstep)  # fmt: skip
        lineage.restore()
        return online

    # --- state ---------------------------------------------------------------------------------------------------

    @property
    def version(self) -> int:
        return self.adapter.version

    @property
    def position(self) -> int:
        """Every log entry up to this seq is settled (trained, skipped, held) as of the latest checkpoint."""
        return self.lineage.position

    @property
    def anchors(self) -> AnchorPool:
        """The served completions the anchors are taken from (the server offers each finished one)."""
        return self.batch_anchors.pool

    @property
    def protected(self) -> ProtectedSubspace | None:
        """The directions every update keeps out of the adapter (computed before the first step; protect_energy)."""
        return self.trainer.protected

    def rollback(self, version: int) -> Future[int]:
        """Asks to serve ``version`` again (0: the base model), as a new version; any thread (``Lineage.rollback``).

        A batch in training is finished first (published and checkpointed, so its feedback counts as trained and
        its version stays a rollback target), and no new one starts meanwhile: dropping it instead would lose its
        work, and rollbacks quicker than a batch would stop training altogether. So this may wait a batch's time.
        In lockstep every replica rolls back, at the next round (``_rollback_slices``)."""
        return self.lineage.rollback(version)

    # --- the step loop's interface -------------------------------------------------------------------------------

    @property
    def in_batch(self) -> bool:
        """A batch (or a lockstep round) is in progress: its slices go on until it ends."""
        return self._job is not None

    def has_work(self) -> bool:
        if self._job is not None:
            return True
        if self.lockstep is not None:  # a round with the others (or a new group) is due, batch or rollback or not
            return self.lockstep.due()
        if self.lineage.rollbacks_asked:
            return True
        if not self.config.enabled:
            return False
        return self._batch_ready()

    def _batch_ready(self) -> bool:
        """Whether this trainer's next batch is ready: ``batch_size`` entries queued, or the oldest waited
        ``max_wait_s``."""
        head = self.queue.head()
        if not head:
            return False
        waited_s = time.time() - min(entry.created_s for entry, _ in head)
        return len(head) >= self.config.queue.batch_size or waited_s >= self.config.queue.max_wait_s

    def run_slice(self) -> float:
        """One slice of training work, or a rollback asked for; returns the seconds it took. Call it from the
        thread that steps the engine, between its steps."""
        t0 = time.perf_counter()
        if self._job is None and self.lockstep is None and self.lineage.rollbacks_asked:
            self.lineage.roll_back_next()
            return time.perf_counter() - t0  # serving's time share counts it; training's seconds do not
        if not self.has_work():
            return 0.0
        if self._job is None and self.lockstep is not None:
            self.lockstep.start_round()
            self._job = self._round_slices() if self.lockstep.joined else self._regroup_slices()
        elif self._job is None:
            self.lineage.watch_regressions()
            self._job = self._train_slices(self.queue.head())
        try:
            next(self._job)
        except StopIteration:
            self._job = None
        except Exception as e:
            # Nothing acknowledged is lost: the batch's entries are still queued in the log, read again later.
            logger.exception("online training failed; its batch will be read again")
            self._job = None
            self.lineage.abandon()
            if self.lockstep is not None:  # the replicas' group is not usable after a failed collective
                self.lockstep.fail(e)
        elapsed = time.perf_counter() - t0
        self.stats.train_s += elapsed
        self._job_s += elapsed
        return elapsed

    # --- one mini-batch ------------------------------------------------------------------------------------------

    def _round_slices(self) -> Generator[None, None, None]:
        """A round of the replicas in lockstep: a rollback if any of them was asked one or the leader found a
        regression (it watches for all: the replicas share the log and serve the same versions), else a batch if
        any has one ready, each with what it has queued (maybe none): a replica's entries younger than ``max_wait_s``
        join the batch another replica's oldest made ready, as a single trainer's batch takes every entry queued."""
        assert self.lockstep is not None
        ready = self._batch_ready()
        regression = self.lineage.regression() if self.lockstep.leader else None
        asked = self.lineage.rollbacks_asked or regression is not None
        busy, rollback = yield from self.lockstep.round_slices(ready, asked)
        if rollback:
            yield from self._rollback_slices(regression)
        elif busy:
            yield from self._train_slices(self.queue.head())

    def _rollback_slices(self, regression: Regression | None) -> Generator[None, None, None]:
        """A rollback in lockstep: the first rank's asked for (or, asked none, the leader's ``regression``), on
        every replica that keeps that version; one that does not (it joined later) takes the new version from one
        that does (``catch_up_slices``)."""
        assert self.lockstep is not None
        asked = self.lineage.rollback_asked()  # this replica's oldest, if still kept
        own = (asked, {"rollback_of": asked}) if asked is not None else None
        if own is None and regression is not None:
            own = (regression.target, regression.metrics)
        proposals = yield from self.lockstep.gather_slices(own)
        chosen = next((p for p in proposals if p is not None), None)
        if chosen is None:  # the versions asked for were pushed out meanwhile (their askers were told)
            return
        version, metrics = chosen  # type: ignore[misc]
        if self.lineage.kept(version):
            self.lineage.serve_again(version, metrics)
        state = yield from self.lockstep.catch_up_slices(self.version, self.lineage.state)
        if state is not None:
            yield from self.lineage.adopt_slices(state)  # type: ignore[arg-type]
        if asked is not None and proposals.index(chosen) == self.lockstep.data_parallel.rank:
            self.lineage.rollback_done(self.version)

    def _regroup_slices(self) -> Generator[None, None, None]:
        """Into the newest generation's group of replicas (``alchemist.training.lockstep``), and, behind the member
        furthest along, its adapter and optimizer state taken: the next round trains from the current version."""
        assert self.lockstep is not None
        if (yield from self.lockstep.form_slices()):
            state = yield from self.lockstep.catch_up_slices(self.version, self.lineage.state)
            if state is not None:
                yield from self.lineage.adopt_slices(state)  # type: ignore[arg-type]

    def _agree_slices(self, flag: bool, every: bool) -> Generator[None, None, bool]:
        """``flag`` as the replicas decide it: all of them (``every``) or any; this trainer's alone without
        lockstep."""
        if self.lockstep is None:
            return flag
        return (yield from (self.lockstep.all_slices(flag) if every else self.lockstep.any_slices(flag)))

    def _train_slices(self, batch: list[tuple[FeedbackEntry, Item]]) -> Generator[None, None, None]:
        """One mini-batch, in slices: the story of this module's docstring (in lockstep, this replica's part of the
        replicas' batch: ``alchemist.training.lockstep`` says what they decide together)."""
        c, lockstep = self.config, self.lockstep
        leader = lockstep is None or lockstep.leader
        # A record is keyed by its response id; any policy may have made one (not only a request's flag): look.
        feedback = FeedbackBatch([it for _, it in batch], c.objectives, c.trainer.group_size)
        anchors = yield from self._prepare_slices(feedback)
        self._job_s = 0.0
        facts, taught_before = (yield from self._taught_slices()) if leader else ([], [])
        rehearsed = self.rehearsal.samples(self.lineage.undone) if leader else []  # the same set on every replica
        num_sft, num_rehearsed = len(feedback.sft), len(rehearsed)
        if lockstep is not None:
            num_sft, num_rehearsed = (yield from lockstep.sum_slices([num_sft, num_rehearsed]))
        # A rehearsed correction weighs what one of the batch's own does; the anchors share anchors.weight.
        rehearsed_scales = [c.objectives.sft_weight / max(num_sft, num_rehearsed, 1)] * len(rehearsed)
        entries = [entry for entry, _ in batch]
        # what an earlier batch carried and this one does not hold (settled since, or left for a later batch) counts
        # from zero again: the counts stay as few as a batch's entries
        self._steps_of = {entry.seq: self._steps_of.get(entry.seq, 0) for entry in entries}
        steps: list[tuple[list[Sample], StepResult]] = []
        yielded = False  # the steps ended early for corrections waiting behind the batch
        for epoch in range(c.stopping.epochs):
            samples, scales = yield from feedback.samples_slices(self.trainer, lockstep)  # z0 under this adapter
            screen = partial(self._screen, entries, feedback, len(samples)) if epoch == 0 else None
            n, rank = (lockstep.world_size, lockstep.data_parallel.rank) if lockstep else (1, 0)
            step_anchors = in_turn(anchors, epoch, c.anchors.turn, n, rank)  # in lockstep: a share of its own pool
            num_anchors = len(step_anchors)
            if lockstep is not None:
                (num_anchors,) = yield from lockstep.sum_slices([num_anchors])
            extra = rehearsed + step_anchors
            extra_scales = rehearsed_scales + [c.anchors.weight / max(num_anchors, 1)] * len(step_anchors)
            # each sample's record or a recompute -> loss -> backward -> update
            step = yield from self.trainer.step_slices(samples + extra, scales + extra_scales, screen)
            if not step.updated:
                return  # suspects quarantined, no update: the rest of the batch, still queued, trains next without them
            steps.append((samples, step))
            for entry in entries:
                self._steps_of[entry.seq] += 1
            if epoch + 1 == c.stopping.epochs:
                break
            learned = self.stopping.reached_target(samples, step.passes) and (
                yield from self.stopping.learned_slices(samples)
            )
            if (yield from self._agree_slices(learned, every=True)):
                break
            if (yield from self._agree_slices(self.stopping.yields([entry.seq for entry in entries]), every=False)):
                yielded = True
                break
        carried = (yield from self._carried_slices(feedback, *steps[-1])) if yielded else set()
        done = [entry for entry in entries if entry.seq not in carried]
        self.stats.carried += len(carried)
        if not (yield from self._agree_slices(bool(done), every=False)):
            return  # every correction goes on in the next batch, beside those waiting, from this adapter
        metrics = {**batch_metrics(feedback, rehearsed, anchors, steps, self.stats, self._job_s), "yielded": yielded,
                   "carried": sorted(carried)}  # fmt: skip
        evaluation = (yield from self._evaluate_slices(facts, taught_before)) if leader else None
        promoted = evaluation is None or evaluation.promoted
        if lockstep is not None and self.gate is not None:  # the leader's verdict
            promoted = bool((yield from lockstep.from_leader_slices([float(promoted)]))[0])
        if promoted:
            taught = None  # the prompts of the corrections it serves: this batch's, or in lockstep every replica's
            if lockstep is not None and self.adapter.cut:
                mine = [e.prompt_token_ids for e in done if e.correction]
                taught = [prompt for part in (yield from lockstep.gather_slices(mine)) for prompt in part]
            yield from self.lineage.publish_slices(done, taught)
        yield from self.lineage.commit_slices(done, metrics, evaluation, self._job_s, promoted)

    def _carried_slices(self, feedback: FeedbackBatch, samples: list[Sample], step: StepResult) -> Generator[
            None, None, set[int]]:  # fmt: skip
        """The seqs of the batch's corrections that go on in the next batch (left queued in the log) when its steps
        end for corrections waiting behind it: those not learned yet (``stopping``'s test, one at a time) that have
        had fewer than ``epochs`` steps, over batches. The others are settled with this batch."""
        learned = yield from self.stopping.learned_each_slices(samples, step.passes)  # its SFT samples, in order
        epochs = self.config.stopping.epochs
        return {item.seq for item, ok in zip(feedback.sft, learned, strict=True)
                if not ok and self._steps_of[item.seq] < epochs}  # fmt: skip

    def _prepare_slices(self, feedback: FeedbackBatch) -> Generator[None, None, list[Sample]]:
        """What every step of the batch uses, computed once: the base model's log-probabilities of the preference
        responses, the anchors with their targets, the protected directions; returns the anchors."""
        if feedback.kto or feedback.dpo:
            yield from feedback.references_slices(self.trainer)  # the base model's, once for all epochs
        anchors = yield from self.batch_anchors.slices()
        energy = self.config.adapter.protect_energy
        if energy and self.trainer.protected is None:
            self.trainer.protected = yield from ProtectedSubspace.load_or_compute_slices(
                self.model, self.tokenizer, self.adapter, energy
            )
            logger.info("protected directions: %s", self.trainer.protected.describe())
        if self.trainer.protected is not None:  # also an adapter just reset, restored or rolled back to (idempotent)
            self.trainer.protected.project_(self.adapter, self.trainer.split, self.trainer.origin)
        return anchors

    def _taught_slices(self) -> Generator[None, None, tuple[list[Pair], list[float]]]:
        """The evaluation gate's facts taught earlier and their losses on the serving state (this batch's start)."""
        if self.gate is None:
            return [], []
        self._gate_s = self.gate.seconds
        facts = [(e.prompt_token_ids, e.response_token_ids) for e in taught_corrections(
            self.log, self.gate.bounds.taught_samples, self.lineage.undone, newest_first=True)]  # fmt: skip
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

    def _screen(
        self,
        batch: list[FeedbackEntry],
        feedback: FeedbackBatch,
        num_samples: int,
        passes: list[tuple[float, bool]],
    ) -> bool:
        """The first step's veto: quarantines the entries whose samples' losses the guard flags; False if any (the
        step then drops its gradients)."""
        entries = {entry.seq: entry for entry in batch}
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
