"""Sliced work: training's torch work is written once, as generators that serving may interrupt.

The convention: an operation that the online trainer runs between engine steps is one generator, named
``<operation>_slices``, that yields wherever serving may take its turn (alchemist.runtime.async_engine) and returns
its result. There is no unsliced twin. A caller that pauses writes ``result = yield from op_slices(...)``; one that
does not (a test, a benchmark, a rollback between batches) writes ``result = run_to_end(op_slices(...))``. The
suffix says it at every call: calling ``op_slices(...)`` alone runs nothing.

    step = yield from trainer.step_slices(samples)          # the online trainer, between engine steps
    step = run_to_end(trainer.step_slices(samples))         # everyone else
"""

from __future__ import annotations

from collections.abc import Generator
from typing import TypeVar

T = TypeVar("T")


def run_to_end(slices: Generator[None, None, T]) -> T:
    """Runs a sliced computation without pausing; returns its result."""
    while True:
        try:
            next(slices)
        except StopIteration as done:
            return done.value


def run_counting(slices: Generator[None, None, T]) -> tuple[T, int]:
    """``run_to_end``, and how many times it paused: where serving could have run (0: no work was sliced)."""
    pauses = 0
    while True:
        try:
            next(slices)
        except StopIteration as done:
            return done.value, pauses
        pauses += 1
