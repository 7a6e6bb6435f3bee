"""Sliced work: a generator that yields wherever serving may take its turn (alchemist.server.async_engine) and
returns its result. The online trainer runs its work this way between engine steps; everyone else runs it through.
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
