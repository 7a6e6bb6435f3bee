"""Printing benchmark results: an aligned table by default, one JSON object per row with --json."""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TextIO


def interleaved_medians(
    fns: dict[str, Callable[[], object]],
    repeats: int,
    warmup: int = 1,
    before: dict[str, Callable[[], object]] | None = None,
) -> dict[str, float]:
    """Median wall time (s) of each function, timed round-robin so that all of them see the same machine noise.

    ``before[name]``, if given, runs untimed before every call of ``fns[name]`` (e.g. dropping a file from the page
    cache)."""
    before = before or {}
    for _ in range(warmup):
        for name, fn in fns.items():
            before.get(name, _nothing)()
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            before.get(name, _nothing)()
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def _nothing() -> None:
    pass


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


def print_rows(rows: Sequence[dict[str, Any]], as_json: bool, out: TextIO = sys.stdout) -> None:
    if as_json:
        for row in rows:
            out.write(json.dumps(row) + "\n")
        return
    if not rows:
        return
    cols = list(rows[0])
    cells = [[_fmt(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    out.write(" | ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True)) + "\n")
    out.write("-|-".join("-" * w for w in widths) + "\n")
    for row in cells:
        out.write(" | ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)) + "\n")
