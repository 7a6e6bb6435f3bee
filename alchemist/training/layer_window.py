"""The prefetch window of the replay walk: a record's layers read in the walk's order, a few layers ahead.

The walk (``alchemist.training.replay``) consumes one prompt layer at a time from the top. A background thread
reads the next layers in that order while the walk computes, holding at most ``depth`` layers that the walk has
not taken yet; the walk drops each layer after use. So peak training memory holds the live forward's kept values plus
``depth + 1`` prompt layers, whichever tier the record lives in (shared/design/activation-reuse.md, section 6),
and a read from host memory or disk overlaps the walk's compute instead of adding to it.

A read that fails (a corrupt or vanished record) is raised to the walk when it takes that layer. ``depth=0`` reads
synchronously in the walk's thread.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

T = TypeVar("T")
_POLL_S = 0.1  # how often a blocked reader checks whether the window was closed


class LayerWindow(Generic[T]):
    def __init__(self, read: Callable[[int], T], order: Iterable[int], depth: int) -> None:
        if depth < 0:
            raise ValueError(f"prefetch depth must be >= 0 (got {depth})")
        self._read = read
        self._order = list(order)
        self._next = 0  # index in order of the next layer to take
        self.depth = depth
        self._thread: threading.Thread | None = None
        if depth:
            self._ready: queue.Queue[tuple[int, T | BaseException]] = queue.Queue()
            self._slots = threading.Semaphore(depth)  # layers read ahead and not yet taken
            self._closed = threading.Event()
            self._thread = threading.Thread(target=self._run, name="alchemist-layer-window", daemon=True)
            self._thread.start()

    def take(self, layer: int) -> T:
        """The next layer in order (must be ``layer``); raises what reading it raised."""
        if self._next >= len(self._order) or self._order[self._next] != layer:
            expected = self._order[self._next] if self._next < len(self._order) else None
            raise RuntimeError(f"layer window: asked for layer {layer}, next in order is {expected}")
        self._next += 1
        if self._thread is None:
            return self._read(layer)
        got, value = self._ready.get()
        self._slots.release()  # the walk holds this one now: the reader may fetch one more
        if isinstance(value, BaseException):
            raise value
        assert got == layer, (got, layer)
        return value

    def close(self) -> None:
        """Stops the reader (e.g. the walk ended early) and drops what it read ahead."""
        if self._thread is None:
            return
        self._closed.set()
        self._thread.join()
        self._thread = None
        self._ready = queue.Queue()

    def __enter__(self) -> LayerWindow[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self) -> None:
        for layer in self._order:
            while not self._slots.acquire(timeout=_POLL_S):
                if self._closed.is_set():
                    return
            if self._closed.is_set():
                return
            try:
                value: T | BaseException = self._read(layer)
            except BaseException as error:  # handed to the walk, which raises it where it takes this layer
                self._ready.put((layer, error))
                return
            self._ready.put((layer, value))
