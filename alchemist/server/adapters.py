"""The adapter endpoints' service: list the kept LoRA adapter versions, roll serving back to one of them.

    GET  /v1/adapters            -> AdapterList (newest first; which one is serving; each version's training metrics)
    POST /v1/adapters/rollback   {"version": 3} -> AdapterInfo of the new version that serves version 3's weights

The versions live in the online trainer's checkpoints (``alchemist.training.checkpoint``); a rollback is the
trainer's (``OnlineTrainer.rollback``): asked for here, in the server's thread pool, and done by the stepping thread
once the batch in training is checkpointed (all torch work runs there: the Note in ``alchemist.runtime.async_engine``).
"""

from __future__ import annotations

from collections.abc import Callable

from alchemist.engine import LLMEngine
from alchemist.server.errors import AdapterNotFoundError, TrainingDisabledError
from alchemist.server.protocol import AdapterInfo, AdapterList, RollbackRequest
from alchemist.training.checkpoint import AdapterCheckpoints, VersionInfo
from alchemist.training.online import OnlineTrainer


class AdapterService:
    def __init__(
        self,
        engine: LLMEngine,
        trainer: OnlineTrainer | None,
        checkpoints: AdapterCheckpoints | None,
        wake: Callable[[], None] = lambda: None,
    ):
        self.engine = engine
        self.trainer = trainer
        self.checkpoints = checkpoints
        self.wake = wake  # the stepping thread looks for work now (a rollback is some)

    def list(self) -> AdapterList:
        serving = self.engine.adapter_version
        versions = self.checkpoints.versions() if self.checkpoints is not None else []
        data = [self._info(v, serving) for v in sorted(versions, key=lambda v: -v.version)]
        return AdapterList(serving_version=serving, training=self.trainer is not None, data=data)

    def rollback(self, req: RollbackRequest) -> AdapterInfo:
        if self.trainer is None or self.checkpoints is None:
            raise TrainingDisabledError()
        try:
            done = self.trainer.rollback(req.version)
            self.wake()
            version = done.result()  # this thread waits; the stepping thread does the work
        except KeyError:
            raise AdapterNotFoundError(req.version, [v.version for v in self.checkpoints.versions()]) from None
        info = next(v for v in self.checkpoints.versions() if v.version == version)
        return self._info(info, version)

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
