"""Training's time on the stepping thread, given by the latency objective: when background work (the online trainer)
runs between engine steps.

    share = TimeShare(trainer, objective, engine.waiting_since)     # objective: alchemist.runtime.objective
    while serving:                              # the stepping thread (alchemist.runtime.async_engine)
        if engine.has_unfinished():
            t0 = time.perf_counter(); engine.step()
            share.after_step(time.perf_counter() - t0)
        elif share.ready():
            share.run_slice()                   # serving idle: training takes the machine, slice by slice

Work runs in slices, never at the same time as a step (concurrent training slowed decode steps severalfold on this
CPU: docs/benchmarks.md, "Training beside a step"), and a slice cannot be stopped once started. With requests in
flight, a token's time is a step plus whatever runs before the next one, so each step earns training what the TPOT
objective leaves (``tpot_s - step_s``; under a derived objective at least ``step_share`` of the step), as credit:
slices run while the next one's estimate (an exponential average of recent slices) fits in the credit, which is
kept up to one such slice or one objective, whichever is longer (a slice that outlasts it is owed, as much again at
most; steps over the objective spend it too). A request's mean time per token (its TPOT) so stays within the
objective, while slices longer than one step's slack still run, every few steps (spent step by step, a slack
shorter than any slice was lost every step, and training crawled beside a light load: docs/benchmarks.md,
"Training beside a light load"). A request waiting for its first token (for admission, or for the rest of its
prompt's prefill) goes first: no slice starts that would end later than its TTFT objective allows (``ttft_s`` after
its arrival). Serving saturated (steps at or over a TPOT objective a user set) leaves training nothing; so that it
still progresses, training kept out for ``MAX_KEPT_OUT_S`` while it has work runs one slice anyway (as a full credit
made it take its turn under the fixed share this replaced, against closed-loop loads: docs/benchmarks.md, "Soak"),
and the backlog policy (``QueueConfig.skip_*_after_s``) gives up on what waits too long. With no request in flight
training runs slice after slice, and a new request waits for one slice at most.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol

from alchemist.runtime.objective import LatencyObjective

logger = logging.getLogger(__name__)

MAX_KEPT_OUT_S = 1.0  # training with work kept out this long by serving takes one slice anyway
SLICE_DECAY = 0.7  # weight of the past in the estimate of the next slice's time (a few slices' memory)


class BackgroundWork(Protocol):
    """Work done in the stepping thread between engine steps, in slices (the online trainer)."""

    def has_work(self) -> bool: ...

    def run_slice(self) -> float: ...  # returns the seconds it took


class TimeShare:
    def __init__(
        self,
        work: BackgroundWork,
        objective: LatencyObjective,
        waiting_since: Callable[[], float | None],
        clock: Callable[[], float] = time.monotonic,
        on_slice: Callable[[float, bool], None] | None = None,
    ) -> None:
        """``waiting_since``: when the longest-waiting request without its first token arrived, on ``clock`` (the
        engine's, ``time.monotonic``), or None; ``on_slice(seconds, serving)``: told each slice's time and whether
        requests were in flight (metrics)."""
        self.work = work
        self.objective = objective
        self.waiting_since = waiting_since
        self.clock = clock
        self.on_slice = on_slice
        self.slice_s: float | None = None  # the next slice's estimate (None before the first)
        self.credit_s = 0.0  # what the objective left after recent steps, not spent yet
        self.kept_out_since: float | None = None  # since when training has had work and no slice

    def ready(self) -> bool:
        return self.work.has_work()

    def after_step(self, step_s: float) -> None:
        """An engine step took ``step_s`` with requests in flight: training's slices in the credit the objective
        has left after it and the steps before, or one anyway if it has been kept out too long."""
        if not self.ready():
            self.kept_out_since, self.credit_s = None, 0.0  # nothing is owed to work that was not there
            return
        cap_s = max(self.objective.tpot_s, self.slice_s or 0.0)
        earned_s = self.objective.tpot_s - step_s  # a step over a TPOT set by hand spends the credit
        if self.objective.step_share:
            earned_s = max(earned_s, self.objective.step_share * step_s)
        self.credit_s = min(cap_s, self.credit_s + earned_s)
        while self.ready() and self._fits(self.credit_s):
            took_s = self.run_slice(serving=True)
            if took_s <= 0:  # it failed: serving goes on
                break
            self.credit_s = max(-cap_s, self.credit_s - took_s)  # a slice longer than the credit is owed
        if not self.ready():
            self.kept_out_since, self.credit_s = None, 0.0
            return
        now = self.clock()
        if self.kept_out_since is None:
            self.kept_out_since = now
        elif now - self.kept_out_since >= MAX_KEPT_OUT_S:
            self.run_slice(serving=True)

    def _fits(self, left_s: float) -> bool:
        """Whether the next slice, as long as recent ones, ends within ``left_s`` and within the TTFT objective of
        the request that has waited longest for admission."""
        slice_s = self.slice_s or 0.0
        if left_s <= 0 or slice_s > left_s:
            return False
        since = self.waiting_since()
        return since is None or self.clock() + slice_s <= since + self.objective.ttft_s

    def run_slice(self, serving: bool = False) -> float:
        """One slice (``serving``: with requests in flight); returns the seconds it took (0 if it failed: the
        worker handles its own failures, this only keeps serving alive)."""
        self.kept_out_since = None
        try:
            took_s = self.work.run_slice()
        except Exception:
            logger.exception("background work failed")
            return 0.0
        self.slice_s = took_s if self.slice_s is None else SLICE_DECAY * self.slice_s + (1 - SLICE_DECAY) * took_s
        if self.on_slice is not None and took_s > 0:
            self.on_slice(took_s, serving)
        return took_s
