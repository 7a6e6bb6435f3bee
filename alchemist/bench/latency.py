"""Client-side latency of streamed requests, as vLLM's benchmark defines it: the clock one stream keeps, and the
p50 / p99 summary over many (``bench serve``, ``bench online``).

TTFT: from sending to the first streamed content. TPOT: (end - TTFT) / (output tokens - 1), per request. ITL: the
gaps between a request's streamed content chunks after the first, over every request's gaps (a pause of the server,
e.g. a training slice, shows whole in the gap it falls in).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol

import numpy as np


class StreamClock:
    """Started when a request is sent; ``content()`` at each streamed content chunk, ``end()`` after the stream."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.first: float | None = None  # the first content chunk
        self.last: float | None = None
        self.gaps: list[float] = []  # between content chunks (ITL)

    def content(self) -> None:
        now = time.perf_counter()
        if self.first is None:
            self.first = now
        else:
            self.gaps.append(now - self.last)
        self.last = now

    @property
    def ttft_s(self) -> float:
        assert self.first is not None, "no content was streamed"
        return self.first - self.start

    def elapsed_s(self) -> float:
        return time.perf_counter() - self.start


class Timed(Protocol):
    """What ``latency_fields`` reads of a request's result."""

    ttft_s: float
    e2e_s: float
    num_tokens: int
    itl_s: list[float]


def latency_fields(results: Sequence[Timed]) -> dict[str, float | None]:
    """TTFT, TPOT and ITL p50 / p99 in ms over ``results`` (None where there is nothing to measure)."""
    ttft = [r.ttft_s for r in results]
    tpot = [(r.e2e_s - r.ttft_s) / (r.num_tokens - 1) for r in results if r.num_tokens > 1]
    itl = [gap for r in results for gap in r.itl_s]
    fields: dict[str, float | None] = {}
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl)):
        for q in (50, 99):
            fields[f"{name}_p{q}_ms"] = round(float(np.percentile(values, q)) * 1e3, 1) if values else None
    return fields
