"""The adapter's lineage: the versions the online trainer made, which one serves, and serving an earlier one again.

    lineage = Lineage(trainer, publisher, log, checkpoints, queue, quarantine, config.adapter, config.rollback,
                      key_share)
    lineage.restore()                        # at start: the checkpoint's adapter serves, its log position holds
    yield from lineage.publish_slices(batch) # a batch's version serves (merged a layer per slice)
    yield from lineage.commit_slices(...)    # checkpointed, then the log told: trained, or held if not promoted
    lineage.rollback(3)                      # any thread: version 3's weights serve again, as a new version

Versions are checkpoints (``alchemist.training.checkpoint``): adapter, optimizer state, the log position up to
which everything is settled, the batch's metrics and seqs. A version the evaluation gate did not promote is kept (a
rollback target) but neither serves nor is trained on: its entries are held for an admin, and the trainer goes on
from the serving version. Exactly once, with the log: an entry stays queued until its batch's checkpoint is
committed, and ``restore`` settles in the log what a crash between the checkpoint and the log's update left.

Rollback serves an earlier version again, as a new version (numbers only grow, so records' staleness stays
meaningful): the adapter and optimizer state of the earlier version become the trainer's, the log position stays
(feedback trained since is not trained again), and the versions after it are ``undone`` ([lo, hi] ranges: lo <
version <= hi; every checkpoint carries the ranges its weights stand for), so what they trained is neither
rehearsed nor served the corrections' ranks for. The regression watch (``alchemist.training.regression``) asks for
one when users rate the versions since some version clearly worse than those before it.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Generator
from concurrent.futures import Future

from alchemist.config.training import AdapterConfig, RollbackConfig
from alchemist.feedback.log import FeedbackEntry, FeedbackLog
from alchemist.model.lora import LoraAdapter, LoraConfig
from alchemist.training.checkpoint import AdapterCheckpoints
from alchemist.training.evaluation import Evaluation
from alchemist.training.feedback_queue import FeedbackQueue
from alchemist.training.quarantine import Quarantine
from alchemist.training.rank_split import RankSplit, widen
from alchemist.training.regression import Regression, find_regression, ratings_by_version
from alchemist.training.seams import AdapterPublisher
from alchemist.training.slices import run_to_end
from alchemist.training.taught import taught_corrections
from alchemist.training.trainer import Trainer

logger = logging.getLogger(__name__)


def adapter_config(config: AdapterConfig) -> LoraConfig:
    """The adapter's: ``lora_r`` ranks plus ``preference_r`` ranks only thumbs and pairs train, scaled as
    ``lora_r`` ranks alone would be (alpha / r = lora_alpha / lora_r)."""
    r = config.lora_r + config.preference_r
    return LoraConfig(r=r, alpha=config.lora_alpha * r / config.lora_r)


def taught_prompts(log: FeedbackLog, version: int, undone: list[list[int]]) -> list[list[int]]:
    """The prompts of the corrections adapter ``version``'s weights hold (trained by it or an earlier version, none
    undone by a rollback: ``undone``, its checkpoint's): the requests like them are served the corrections' ranks
    (alchemist.engine.router). From the log, so a restart or a rollback knows them."""
    entries = taught_corrections(log, 1 << 62, undone)
    return [e.prompt_token_ids for e in entries if e.trained_version is not None and e.trained_version <= version]


def as_trained(adapter: LoraAdapter, config: AdapterConfig, log: FeedbackLog, version: int, undone: list[list[int]]):
    """A checkpoint's ``adapter`` as the online trainer of ``config`` made it, to serve without that trainer: its
    corrections' ranks cut and routed to the prompts they were taught on, where ``config`` cuts them."""
    if config.preference_r and config.route_corrections and adapter.config.r == adapter_config(config).r:
        RankSplit(adapter, config.preference_r, cut=True)
        adapter.taught = taught_prompts(log, version, undone)
    return adapter


def unpromoted(version: int, reason: str) -> str:
    return f"adapter version {version}, which trained it, was not promoted: {reason}"


class Lineage:
    def __init__(
        self,
        trainer: Trainer,
        publisher: AdapterPublisher,
        log: FeedbackLog,
        checkpoints: AdapterCheckpoints,
        queue: FeedbackQueue,
        quarantine: Quarantine,
        config: AdapterConfig,
        watch: RollbackConfig,
        key_share: float,
        initial: LoraAdapter | None = None,
    ) -> None:
        """The versions of ``trainer``'s adapter: published to ``publisher``, kept in ``checkpoints``, their
        entries settled in ``log`` (``queue`` reads it again after a change; ``quarantine`` holds what an
        unpromoted version trained). ``watch``: the regression watch's bounds; one key counts ``key_share`` of the
        ratings it needs at most. ``initial``: the adapter it starts from (a named adapter as loaded, its version 1:
        ``restore``), None for a fresh one that serves the base model (the shared adapter, its version 0)."""
        self.trainer, self.adapter, self.stats = trainer, trainer.adapter, trainer.stats
        self.publisher, self.log, self.checkpoints = publisher, log, checkpoints
        self.queue, self.quarantine = queue, quarantine
        self.config, self.watch, self.key_share = config, watch, key_share
        self.initial = initial
        self.position = 0  # every log entry up to this seq is settled (trained, skipped, held) as of the checkpoint
        # Versions a rollback undid, as [lo, hi] ranges (lo < version <= hi): what they trained is not rehearsed.
        # Every checkpoint carries the ranges its weights stand for ("undone"), so a restart or a later rollback
        # to it knows them.
        self.undone: list[list[int]] = []
        # Rollbacks asked for (any thread), done by the slices' thread at the next batch boundary.
        self._rollbacks: list[tuple[int, Future[int]]] = []
        self._rollbacks_lock = threading.Lock()

    @property
    def version(self) -> int:
        return self.adapter.version

    # --- state ---------------------------------------------------------------------------------------------------

    def restore(self) -> None:
        """Continue from the latest checkpoint (if any): its adapter served, its optimizer state, its position. An
        ``initial`` adapter is checkpointed first, as version 1, when there is none: a named adapter always serves
        a version >= 1 (the engine's version 0 is the base model, whose cached prefixes it must not share)."""
        latest = self.checkpoints.latest()
        if latest is None and self.initial is not None:
            self.load_initial()
            self.adapter.version = 1
            position = self.log.settled_through()  # where this adapter's queue starts
            state = self.trainer.optimizer.state_dict()
            latest = run_to_end(self.checkpoints.save_slices(1, self.adapter, state, position, {"initial": True}))
        if latest is None:
            return
        served = self.load_serving()
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
                    reason = unpromoted(info.version, info.metrics["evaluation"]["reason"])
                    self.quarantine.hold(entry, reason, info.metrics.get("loss", float("nan")))
        passed = self.log.queued_seqs(through_seq=self.position)
        self.log.mark_trained([seq for seq, kind in passed if kind == "sft"], None)
        for kind in {kind for _, kind in passed if kind != "sft"}:
            seqs = [seq for seq, k in passed if k == kind]
            self.log.mark_skipped(seqs, f"logged before the trainer trained {kind!r} feedback")

    def load_serving(self) -> int:
        """The trainer's adapter and optimizer state become the newest promoted version's (the one that serves: a
        version the evaluation gate kept from serving is not trained on); returns its number (0: the base model)."""
        serving = self.checkpoints.serving()
        if serving is None:
            self.load_initial()
            return 0
        self._load(serving.version)
        return serving.version

    def _load(self, version: int) -> None:
        model = self.trainer.model
        adapter, optimizer_state, _ = self.checkpoints.load(version, model.config, model.device)
        info = next(v for v in self.checkpoints.versions() if v.version == version)
        self.undone = [list(r) for r in info.metrics.get("undone", [])]
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
        self.adapter.taught = taught_prompts(self.log, version, self.undone) if self.adapter.cut else []

    def load_initial(self) -> None:
        """The adapter as it starts (B = 0: it serves exactly the base model's outputs; or ``initial``'s weights), a
        fresh optimizer."""
        initial = self.initial or LoraAdapter(self.adapter.model_config, self.adapter.config, seed=self.config.seed)
        self.adapter.load_state_dict(initial.state_dict())
        self.trainer.optimizer.state.clear()
        self.undone = []
        self.adapter.taught = []

    def abandon(self) -> None:
        """A batch in progress dropped: back to the latest checkpoint's adapter and optimizer state (epochs already
        applied must not count); the queue reads the log again from its position."""
        self.queue.changed()
        self.trainer.optimizer.zero_grad(set_to_none=True)
        latest = self.checkpoints.latest()
        self.load_serving()
        self.adapter.version = 0 if latest is None else latest.version

    def state(self) -> dict:
        """What another replica needs to go on from this trainer's version (``adopt_slices``)."""
        adapter = {name: t.detach().cpu() for name, t in self.adapter.state_dict().items()}
        return {"version": self.version, "adapter": adapter, "optimizer": self.trainer.optimizer.state_dict(),
                "undone": self.undone}  # fmt: skip

    def adopt_slices(self, state: dict) -> Generator[None, None, None]:
        """Catches up with a replica further along (``state``: its ``state()``; a replica restarted from an older
        checkpoint, in lockstep): its version becomes this trainer's, checkpointed and served. The log is shared:
        what that version trained is settled there already, and its taught prompts are read from it."""
        self.adapter.load_state_dict(state["adapter"])
        self.trainer.optimizer.load_state_dict(state["optimizer"])
        self.adapter.version, self.undone = state["version"], [list(r) for r in state["undone"]]
        self.adapter.taught = taught_prompts(self.log, self.version, self.undone) if self.adapter.cut else []
        position = self.log.settled_through()
        metrics = {"adopted": True, **({"undone": self.undone} if self.undone else {})}
        optimizer_state = self.trainer.optimizer.state_dict()
        yield from self.checkpoints.save_slices(self.version, self.adapter, optimizer_state, position, metrics)
        self.position = position
        yield from self.publisher.set_adapter_slices(self.adapter, self.version)
        self.queue.changed()
        logger.info("online trainer: caught up with the replicas at adapter version %d", self.version)

    # --- a batch's version -----------------------------------------------------------------------------------------

    def publish_slices(
        self, batch: list[FeedbackEntry], taught: list[list[int]] | None = None
    ) -> Generator[None, None, None]:
        """The batch's version serves: its corrections are taught now (the requests like them get the corrections'
        ranks; ``taught``: their prompts, where the batch holds others' too, in lockstep), merged into the publisher
        a layer per slice."""
        if self.adapter.cut:
            if taught is None:
                taught = [e.prompt_token_ids for e in batch if e.correction]
            self.adapter.taught = [*self.adapter.taught, *taught]
        yield from self.publisher.set_adapter_slices(self.adapter, self.version)
        yield

    def commit_slices(
        self, batch: list[FeedbackEntry], metrics: dict, evaluation: Evaluation | None, train_s: float,
        promoted: bool | None = None,
    ) -> Generator[None, None, None]:  # fmt: skip
        """Checkpoints the batch's version (``train_s``: its slices' seconds, the evaluation's included), then
        tells the log: its entries trained (promoted) or held (not). ``promoted`` None: the evaluation's verdict
        (promoted without one); a replica in lockstep gives the leader's."""
        if promoted is None:
            promoted = evaluation is None or evaluation.promoted
        reason = evaluation.reason if evaluation is not None else "the leader replica's evaluation gate"
        seqs = [entry.seq for entry in batch]
        metrics = {**metrics, "seqs": seqs, "train_s": train_s}
        if self.undone:
            metrics["undone"] = self.undone
        if evaluation is not None:
            metrics["evaluation"] = evaluation.as_dict()
        state = self.trainer.optimizer.state_dict()
        position = self.log.settled_through(excluding=seqs)
        yield from self.checkpoints.save_slices(self.version, self.adapter, state, position, metrics)
        self.position = position
        if promoted:
            self.log.mark_trained(seqs, self.version)  # after the commit: restore() redoes it if lost
        else:  # kept, a rollback target, but not served nor trained on: its entries are held for an admin
            logger.warning("adapter version %d not promoted: %s", self.version, reason)
            self.stats.unpromoted += 1
            for entry in batch:
                self.stats.quarantined += self.quarantine.hold(entry, unpromoted(self.version, reason), metrics["loss"])
            self.load_serving()  # the trainer goes on from the serving version (its number stays: numbers grow)
        self.queue.changed()

    # --- rollback ----------------------------------------------------------------------------------------------

    def rollback(self, version: int) -> Future[int]:
        """Asks to serve ``version`` again (0: the base model), as a new version; any thread. The future gives the
        new version's number once ``roll_back_next`` has made it (KeyError: ``version`` is not kept); KeyError
        here already if it is not kept now."""
        if not self.kept(version):
            raise KeyError(version)
        done: Future[int] = Future()
        with self._rollbacks_lock:
            self._rollbacks.append((version, done))
        return done

    @property
    def rollbacks_asked(self) -> bool:
        return bool(self._rollbacks)

    def kept(self, version: int) -> bool:
        return version == 0 or version in {v.version for v in self.checkpoints.versions()}

    def rollback_asked(self) -> int | None:
        """The oldest rollback asked for, if its version is still kept (else its asker learns it: KeyError, and the
        next one's is looked at); it stays asked until ``rollback_done``. In lockstep (``roll_back_next`` alone)."""
        while self._rollbacks:
            version, done = self._rollbacks[0]
            if self.kept(version):
                return version
            with self._rollbacks_lock:
                self._rollbacks.pop(0)
            if done.set_running_or_notify_cancel():
                done.set_exception(KeyError(version))
        return None

    def rollback_done(self, version: int) -> None:
        """The oldest rollback asked for was made, as ``version``: its asker learns it."""
        with self._rollbacks_lock:
            _, done = self._rollbacks.pop(0)
        if done.set_running_or_notify_cancel():
            done.set_result(version)

    def roll_back_next(self) -> None:
        """The oldest rollback asked for, in the slices' thread, between batches."""
        with self._rollbacks_lock:
            version, done = self._rollbacks.pop(0)
        if not done.set_running_or_notify_cancel():
            return
        try:
            if not self.kept(version):  # the last batch's checkpoint pushed it out (keep_versions)
                raise KeyError(version)
            self.serve_again(version, {"rollback_of": version})
        except Exception as e:  # the asker learns it (a 404, a 500); training goes on
            done.set_exception(e)
        else:
            done.set_result(self.version)

    def serve_again(self, version: int, metrics: dict) -> int:
        """Between batches: ``version``'s weights (0: the base model's) become a new version that serves."""
        self.queue.changed()
        newest = max([self.version, *(v.version for v in self.checkpoints.versions())])
        if version == 0:
            self.load_initial()
        else:
            self._load(version)
        if version < newest:  # what the versions after it trained is not rehearsed again
            self.undone.append([version, newest])
        metrics = {**metrics, **({"undone": self.undone} if self.undone else {})}
        self.adapter.version = newest + 1
        self.publisher.set_adapter(self.adapter, self.version)
        state = self.trainer.optimizer.state_dict()
        run_to_end(self.checkpoints.save_slices(self.version, self.adapter, state, self.position, metrics))
        return self.version

    def watch_regressions(self) -> None:
        """Between batches: serving goes back past versions its users rate clearly worse than those before them
        (``alchemist.training.regression``)."""
        found = self.regression()
        if found is not None:
            self.serve_again(found.target, found.metrics)

    def regression(self) -> Regression | None:
        """The versions served since the last rollback that users rate clearly worse than those before them, if
        any, and the version before them still kept (its ``metrics``: the rollback's, ``serve_again``'s)."""
        if self.watch.min_ratings <= 0:
            return None
        per_key = max(1, math.ceil(self.key_share * self.watch.min_ratings))
        found = find_regression(self._served_in_turn(), ratings_by_version(self.log.ratings(), per_key), self.watch)
        if found is None or not self.kept(found.target):
            return None
        logger.warning("adapter version %d serves again: %s", found.target, found.reason)
        return found

    def _served_in_turn(self) -> list[int]:
        """The versions served one after another since the last rollback (or since the base model, while every
        version since it is kept), oldest first."""
        kept = self.checkpoints.versions()
        served = [v for v in kept if v.promoted]
        last = max((i for i, v in enumerate(served) if "rollback_of" in v.metrics), default=None)
        if last is not None:
            return [v.version for v in served[last:]]
        base = [0] if kept and kept[0].version == 1 else []
        return base + [v.version for v in served]
