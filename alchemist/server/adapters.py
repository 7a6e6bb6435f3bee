"""The adapter endpoints' service: list the kept LoRA adapter versions, roll serving back to one of them.

    GET  /v1/adapters            -> AdapterList (newest first; which one is serving; each version's training metrics)
    POST /v1/adapters/rollback   {"version": 3} -> AdapterInfo of the new version that serves version 3's weights
    GET  /v1/adapters?adapter=team-a, POST /v1/adapters/rollback {"version": 1, "adapter": "team-a"}: a named
                                 adapter's versions (its own trainer's: alchemist.runtime.trainers)
    GET  /v1/adapters/summary    -> AdapterSummaryList: every adapter the caller may use at a glance (the
                                 dashboard's table): version serving, training, feedback queued, where its weights are

The versions live in the online trainer's checkpoints (``alchemist.training.checkpoint``); a rollback is the
trainer's (``OnlineTrainer.rollback``): asked for here, in the server's thread pool, and done by the stepping thread
once the batch in training is checkpointed (all torch work runs there: the Note in ``alchemist.runtime.async_engine``).
"""

from __future__ import annotations

from collections.abc import Callable

from alchemist.engine import LLMEngine
from alchemist.feedback.log import FeedbackLog
from alchemist.runtime.adapter_registry import AdapterRegistry
from alchemist.runtime.trainers import Trainers
from alchemist.server.auth import ANONYMOUS, Caller
from alchemist.server.errors import (
    AdapterNotFoundError,
    NamedAdapterNotFoundError,
    PermissionDeniedError,
    TrainingDisabledError,
)
from alchemist.server.protocol import AdapterInfo, AdapterList, AdapterSummary, AdapterSummaryList, RollbackRequest
from alchemist.training.checkpoint import AdapterCheckpoints, VersionInfo
from alchemist.training.online import OnlineTrainer


class AdapterService:
    def __init__(
        self,
        engine: LLMEngine,
        trainer: OnlineTrainer | None,
        checkpoints: AdapterCheckpoints | None,
        wake: Callable[[], None] = lambda: None,
        trainers: Trainers | None = None,
        log: FeedbackLog | None = None,
        registry: AdapterRegistry | None = None,
    ):
        """``trainers``: the named adapters' trainers too (None: the shared adapter's alone); ``log`` and
        ``registry`` (the named adapters served) for ``summary`` (None: no backlog, no named adapters)."""
        self.engine = engine
        self.trainer = trainer
        self.checkpoints = checkpoints
        self.wake = wake  # the stepping thread looks for work now (a rollback is some)
        self.trainers = trainers
        self.log = log
        self.registry = registry

    def list(self, adapter: str | None = None, caller: Caller = ANONYMOUS) -> AdapterList:
        """The versions of the shared adapter, or of the named ``adapter`` where ``caller`` may use it (a 403)."""
        if adapter is not None and not caller.may_use(adapter):
            raise PermissionDeniedError(f"The key {caller.name!r} may not see the adapter {adapter!r} (a user key "
                                        "sees only its own adapter)")  # fmt: skip
        trainer, checkpoints, serving = self._of(adapter)
        versions = checkpoints.versions() if checkpoints is not None else []
        data = [self._info(v, serving) for v in sorted(versions, key=lambda v: -v.version)]
        return AdapterList(serving_version=serving, training=trainer is not None, data=data)

    def summary(self, caller: Caller = ANONYMOUS) -> AdapterSummaryList:
        """The shared adapter, then each named adapter ``caller`` may use (those /v1/models lists for it), by name.
        On the event loop thread: the registry's state is that thread's (``alchemist.runtime.adapter_registry``)."""
        backlog = self.log.backlog_by_adapter() if self.log is not None else {}  # one query for every adapter
        trains = self.trainer is not None
        rows = [AdapterSummary(adapter=None, serving_version=self.engine.adapter_version, training="on" if trains
                               else "off", backlog=backlog.get(None, 0), residence="engine")]  # fmt: skip
        if self.registry is None:
            return AdapterSummaryList(data=rows)
        trained = self.trainers.named if self.trainers is not None else {}
        versions = self.engine.named_adapters
        for name in sorted(self.registry.paths()):
            if not caller.may_use(name):
                continue
            # An untrained adapter's engine version is the registry's (a prefix-cache key), not a version of its
            # own: it has none here, so none is shown.
            version = versions.get(name, 0) if name in trained else None
            training = "on" if name in trained else "frozen" if trains else "off"
            residence = self.registry.residence(name)
            rows.append(AdapterSummary(adapter=name, serving_version=version, training=training,
                                       backlog=backlog.get(name, 0), residence=residence))  # fmt: skip
        return AdapterSummaryList(data=rows)

    def rollback(self, req: RollbackRequest) -> AdapterInfo:
        trainer, checkpoints, _ = self._of(req.adapter)
        if trainer is None or checkpoints is None:
            raise TrainingDisabledError()
        try:
            done = trainer.rollback(req.version)
            self.wake()
            version = done.result()  # this thread waits; the stepping thread does the work
        except KeyError:
            raise AdapterNotFoundError(req.version, [v.version for v in checkpoints.versions()]) from None
        info = next(v for v in checkpoints.versions() if v.version == version)
        return self._info(info, version)

    def _of(self, adapter: str | None) -> tuple[OnlineTrainer | None, AdapterCheckpoints | None, int]:
        """(its trainer, its checkpoints, the version serving) of the shared adapter (None) or a trained named one
        (NamedAdapterNotFoundError, a 404, for another name)."""
        if adapter is None:
            return self.trainer, self.checkpoints, self.engine.adapter_version
        named = self.trainers.named if self.trainers is not None else {}
        if adapter not in named:
            raise NamedAdapterNotFoundError(adapter, sorted(named), param="adapter", what="trained")
        trainer = named[adapter]
        return trainer, trainer.checkpoints, self.engine.named_adapters.get(adapter, 0)

    @staticmethod
    def _info(v: VersionInfo, serving: int) -> AdapterInfo:
        return AdapterInfo(
            id=f"v{v.version}",
            version=v.version,
            created=int(v.created_s),
            serving=v.version == serving,
            log_position=v.log_position,
            promoted=v.promoted,
            metrics=v.metrics,
        )
