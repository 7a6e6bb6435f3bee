"""The online trainers of a replica: the shared adapter's, and one per named adapter it trains, taking turns.

    make = partial(named_trainer, engine, store, log, config, data_dir)
    trainers = Trainers(shared, make)                                # the shared adapter's OnlineTrainer
    trainers.add("team-a", make("team-a", adapter))                  # at build time (--lora-modules)
    done = trainers.start("team-b", adapter_b)                       # at run time, any thread: made in a slice
    share = TimeShare(trainers, objective, engine.waiting_since)     # training's time, whoever's work it is

A named adapter (given with ``--lora-modules``, or loaded at run time) learns from the feedback on its own responses
only: its trainer is an ``OnlineTrainer`` like the shared one, built from the same config, over its own view of the
log (``alchemist.feedback.adapter_log``: its queue, position, taught corrections and ratings are its own, so its
batches never hold another adapter's entries), with its own lineage (checkpoints in PEFT's format under
``<data_dir>/adapters/<name>/``, evaluation gate verdicts, versions, rollback, regression watch), publishing to the
engine under its name (``NamedPublisher``). It starts from the adapter as loaded (its version 1, checkpointed at the
first start: ``Lineage.restore``), which its anchors and evaluation gate hold it to, and trains it with its own rank
and targets (no preference ranks are split off an adapter made elsewhere, so its corrections serve to all its
requests rather than being routed).

Fair turns: training's time (``alchemist.runtime.time_share``) goes to one batch at a time, and each new batch to the
next trainer in turn that has work (round-robin over the trainers with a backlog), so a flood of one team's feedback
delays another team's by one batch at most. A batch, once started, has the slices until it ends: its adapter,
optimizer state and pinned records are one trainer's, and interleaving two batches would hold both in memory.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Generator
from concurrent.futures import Future
from pathlib import Path

from alchemist.activations.store import ActivationStore
from alchemist.config import OnlineConfig
from alchemist.engine import LLMEngine
from alchemist.feedback.adapter_log import AdapterLog
from alchemist.feedback.log import FeedbackLog
from alchemist.model.lora import LoraAdapter
from alchemist.training.checkpoint import ADAPTER_DIR, TMP_PREFIX, VERSION_DIR, AdapterCheckpoints
from alchemist.training.online import OnlineTrainer

logger = logging.getLogger(__name__)


class NamedPublisher:
    """The engine as a named adapter's ``AdapterPublisher`` (``alchemist.training.seams``): its versions serve under
    its name. Named adapters are served as their separate delta, never merged, so there is no merge to make in
    training's slices: both ways set it at once."""

    def __init__(self, engine: LLMEngine, name: str) -> None:
        self.engine, self.name = engine, name

    def set_adapter(self, adapter: LoraAdapter | None, version: int) -> None:
        assert adapter is not None, "a named adapter serves a version >= 1, never the base model alone"
        self.engine.set_adapter(adapter, version, name=self.name)

    def set_adapter_slices(self, adapter: LoraAdapter, version: int) -> Generator[None, None, None]:
        self.set_adapter(adapter, version)
        yield


def checkpoint_dir(data_dir: str | Path, name: str) -> Path:
    """Where a named adapter's versions are kept: ``<data_dir>/adapters/<name>``, beside the shared adapter's
    versions; ValueError for a name that would be one of those or leave the directory."""
    parts = name.split("/")
    if VERSION_DIR.fullmatch(parts[0]) or name.startswith(TMP_PREFIX) or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"adapter name {name!r} cannot be trained: its checkpoints would lie at adapters/{name} "
                         "among the shared adapter's versions, or outside the data directory; choose another")
    return Path(data_dir) / "adapters" / name


def served_path(data_dir: str | Path, name: str, path: str | Path) -> Path:
    """The directory a named adapter given as ``path`` serves from when nothing trains it (``--no-train``): the
    version its training left serving (its newest promoted checkpoint's PEFT directory), if it was ever trained
    here, else ``path``: a restart without training must not serve a team's adapter as it was before its
    feedback."""
    try:
        directory = checkpoint_dir(data_dir, name)
    except ValueError:  # a name that is never trained
        return Path(path)
    if not directory.is_dir():
        return Path(path)
    serving = AdapterCheckpoints(directory, keep=1 << 30).serving()  # keep: nothing is pruned by reading
    return Path(path) if serving is None else serving.path / ADAPTER_DIR


def named_trainer(
    engine: LLMEngine,
    store: ActivationStore | None,
    log: FeedbackLog,
    config: OnlineConfig,
    data_dir: str | Path,
    name: str,
    adapter: LoraAdapter,
) -> OnlineTrainer:
    """The trainer of the named adapter ``name``, starting from ``adapter`` (as loaded) or its latest checkpoint,
    its serving version set in ``engine`` under its name."""
    checkpoints = AdapterCheckpoints(checkpoint_dir(data_dir, name), config.adapter.keep_versions)
    config = dataclasses.replace(config, adapter=dataclasses.replace(config.adapter, preference_r=0))
    return OnlineTrainer.from_config(engine.model, engine.tokenizer, NamedPublisher(engine, name), store,
                                     AdapterLog(log, name), checkpoints, config, initial=adapter)  # fmt: skip


class Trainers:
    """Every online trainer of the replica, as the time share's one ``BackgroundWork``; the module doc says how
    they take turns."""

    def __init__(
        self, shared: OnlineTrainer, make: Callable[[str, LoraAdapter], OnlineTrainer] | None = None
    ) -> None:
        """``make(name, adapter)``: a named adapter's trainer, for ``start`` (None: none at run time)."""
        self.shared = shared
        self.named: dict[str, OnlineTrainer] = {}
        self._make = make
        self._turns: list[OnlineTrainer] = [shared]
        self._next = 0  # the first trainer asked when a new batch starts
        self._current: OnlineTrainer | None = None  # the one whose batch has the slices
        self._pending: list[tuple[str, LoraAdapter, Future[None]]] = []  # ``start``ed, not made yet
        self._pending_lock = threading.Lock()

    def add(self, name: str, trainer: OnlineTrainer) -> None:
        """``trainer`` trains the named adapter ``name`` from now on (build time, or the stepping thread)."""
        self._check_new(name)
        self.named[name] = trainer
        self._turns.append(trainer)

    def start(self, name: str, adapter: LoraAdapter) -> Future[None]:
        """Any thread (a run-time load): ``name`` is trained from now on, from ``adapter`` as loaded (or its latest
        checkpoint, a name trained before). Its trainer is made in a slice of the stepping thread, as all torch
        work is (its restore sets it in the engine); the future is done then, or fails with ``make``'s error."""
        if self._make is None:
            raise ValueError("this server trains no named adapter at run time")
        done: Future[None] = Future()
        with self._pending_lock:
            self._pending.append((name, adapter, done))
        return done

    @property
    def trains_at_run_time(self) -> bool:
        """Whether ``start`` may be called (adapters loaded at run time are trained)."""
        return self._make is not None

    def __contains__(self, name: object) -> bool:
        """Whether the named adapter ``name`` is trained (its feedback is accepted)."""
        return name in self.named

    def has_work(self) -> bool:
        return bool(self._pending) or any(trainer.has_work() for trainer in self._turns)

    def run_slice(self) -> float:
        """A slice of the batch in progress, else a trainer started at run time made, else a slice of the next
        trainer in turn that has work; its seconds."""
        if self._current is None or not self._current.in_batch:
            if self._pending:
                return self._make_pending()
            self._current = self._next_with_work()
            if self._current is None:
                return 0.0
        return self._current.run_slice()

    def _make_pending(self) -> float:
        t0 = time.perf_counter()
        with self._pending_lock:
            name, adapter, done = self._pending.pop(0)
        assert self._make is not None
        try:
            self._check_new(name)  # before its trainer restores (and serves) the name's checkpoints
            self.add(name, self._make(name, adapter))
        except Exception as e:  # the loader learns it (a 400); training goes on
            done.set_exception(e)
        else:
            done.set_result(None)
        return time.perf_counter() - t0

    def _check_new(self, name: str) -> None:
        if name in self.named:
            raise ValueError(f"adapter {name!r} has a trainer already")

    def _next_with_work(self) -> OnlineTrainer | None:
        for i in range(len(self._turns)):
            trainer = self._turns[(self._next + i) % len(self._turns)]
            if trainer.has_work():
                self._next = (self._next + i + 1) % len(self._turns)
                return trainer
        return None
