"""Training's share of the stepping thread: when background work (the online trainer) runs between engine steps.

    share = TimeShare(trainer, engine.has_arrivals, online.time_share.share, online.time_share.quantum_s)
    while serving:                              # the stepping thread (alchemist.runtime.async_engine)
        if engine.has_unfinished():
            t0 = time.perf_counter(); engine.step()
            share.after_step(time.perf_counter() - t0)
        elif share.ready():
            share.run_slice()                   # serving idle: training takes the machine, slice by slice

Work runs in slices, never at the same time as a step (concurrent training slowed decode steps severalfold on this
CPU: docs/benchmarks.md, "Training beside a step"). With requests in flight it may take ``share`` of the time: each
engine step earns it ``step_s * share / (1 - share)`` seconds of credit (capped), each slice spends what it took: by
default one slice after an engine step whenever the credit is positive. With ``quantum_s`` > 0 the credit is spent
in turns instead: once it reaches ``quantum_s``, slices run back to back until it is spent or the turn has lasted
``quantum_s`` (plus the slice that crosses it), then serving steps until it is earned again; a request that arrives
ends a turn after the slice in progress, and one that arrived during a step is scheduled before any slice runs,
unless training's credit is full (``MAX_CREDIT_S``): then training takes its turn anyway, so that a steady stream of
arrivals cannot starve it (16 closed-loop clients did in `alchemist bench soak`: docs/benchmarks.md, "Soak"). Each
switch finds the other side's data out of the caches, and a replay's slices are small (a layer): in ``bench online``
turns let the replay trainer train faster under load, but serving's TPOT measured worse with them in every pair
(docs/benchmarks.md, "Why the defaults"), so they are off by default. With no request in flight training runs slice
after slice, and a new request waits for one slice at most.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

logger = logging.getLogger(__name__)

MAX_CREDIT_S = 1.0  # training credit saved up while serving is busy: at most this much in a burst


class BackgroundWork(Protocol):
    """Work done in the stepping thread between engine steps, in slices (the online trainer)."""

    def has_work(self) -> bool: ...

    def run_slice(self) -> float: ...  # returns the seconds it took


class TimeShare:
    def __init__(
        self,
        work: BackgroundWork,
        has_arrivals: Callable[[], bool],
        share: float,  # no defaults here: OnlineConfig's train_share and train_quantum_s are the one place
        quantum_s: float,
        on_slice: Callable[[float, bool], None] | None = None,
    ) -> None:
        """``has_arrivals``: whether a request was added since the last engine step began (the engine's);
        ``on_slice(seconds, serving)``: told each slice's time and whether requests were in flight (metrics)."""
        self.work = work
        self.on_slice = on_slice
        self.has_arrivals = has_arrivals
        self.share = share
        self.quantum_s = quantum_s
        self.credit_s = 0.0

    def ready(self) -> bool:
        return self.work.has_work()

    def after_step(self, step_s: float) -> None:
        """An engine step took ``step_s`` with requests in flight: earn credit, and take a turn if it is due."""
        self.credit_s = min(2 * MAX_CREDIT_S, self.credit_s + step_s * self.share / (1.0 - self.share))
        due = self.credit_s > 0 and self.credit_s >= self.quantum_s
        # A request that arrived during the step goes first, unless training's credit is full: under a closed-loop
        # load something arrives during nearly every step, and training never ran (bench soak).
        if due and (not self.has_arrivals() or self.credit_s >= MAX_CREDIT_S):
            self._run_turn()

    def _run_turn(self) -> None:
        """Training's turn while serving is busy: slices back to back until the credit is spent or the turn has
        lasted ``quantum_s`` (credit saved up while training had no work is spent a turn at a time), training has
        no work, or a request arrives (serving has priority: it ends the turn). But a full credit is first spent
        below full: what a step earns past full is kept (up to twice full) and spent in the next turn, so that under
        arrivals at every step training still gets its share, not one slice a step (bench soak: docs/benchmarks.md,
        "Soak")."""
        turn_s = 0.0
        while self.credit_s > 0 and self.ready():
            took_s = self.run_slice(serving=True)
            self.credit_s -= took_s
            turn_s += took_s
            if (turn_s >= self.quantum_s or self.has_arrivals()) and self.credit_s < MAX_CREDIT_S:
                return

    def run_slice(self, serving: bool = False) -> float:
        """One slice (``serving``: with requests in flight); returns the seconds it took (0 if it failed: the
        worker handles its own failures, this only keeps serving alive)."""
        try:
            took_s = self.work.run_slice()
        except Exception:
            logger.exception("background work failed")
            return 0.0
        if self.on_slice is not None and took_s > 0:
            self.on_slice(took_s, serving)
        return took_s
