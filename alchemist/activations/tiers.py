"""Copies between the store's memory tiers: device (where records are computed and trained on) and host.

On CPU the two tiers are the same process memory under separate budgets: a demotion hands the tensors over and a read
returns them, no copy. On CUDA (the one capability check, ``is_cuda``) the host tier is pinned memory and the copies
run on side streams, ordered by events: the serving stream never waits for a demotion, and a read makes only the
reading stream wait for its own copy.

An event (``ready``) travels with a record's tensors: once it has passed, they are complete. None on CPU.
"""

from __future__ import annotations

import threading

import torch

Layer = dict[str, torch.Tensor]  # name -> (num_tokens, width)


def is_cuda(device: torch.device) -> bool:
    return device.type == "cuda"


def _pinned(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=True)


class TierCopies:
    def __init__(self) -> None:
        self._streams: dict[tuple[torch.device, str], torch.cuda.Stream] = {}
        self._lock = threading.Lock()  # the engine thread demotes, the trainer's threads read

    def mark(self, device: torch.device) -> torch.cuda.Event | None:
        """The ``ready`` event of tensors written by the work queued so far on the current stream (a put)."""
        if not is_cuda(device):
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        return event

    def to_host(
        self, layers: list[Layer], device: torch.device, ready: torch.cuda.Event | None
    ) -> tuple[list[Layer], torch.cuda.Event | None]:
        """Host copies of device ``layers`` and their ``ready`` event (CPU: the same tensors)."""
        if not is_cuda(device):
            return layers, ready
        side = self._side(device, "down")
        if ready is not None:
            side.wait_event(ready)
        with torch.cuda.stream(side):
            host = [{n: _pinned(t).copy_(t, non_blocking=True) for n, t in x.items()} for x in layers]
        # Note: [the sources may be freed before the copy ran] the store drops its device tensors as soon as the
        # copy is queued; the caching allocator keeps their memory from reuse until the side stream passed here.
        for layer in layers:
            for t in layer.values():
                t.record_stream(side)
        done = torch.cuda.Event()
        done.record(side)
        return host, done

    def to_device(self, layer: Layer, device: torch.device, ready: torch.cuda.Event | None) -> Layer:
        """``layer`` on ``device`` for the current stream (CPU, or already there: the same tensors)."""
        if not is_cuda(device):
            return layer
        current = torch.cuda.current_stream(device)
        if all(t.is_cuda for t in layer.values()):  # the device tier: nothing to copy
            if ready is not None:
                current.wait_event(ready)
            return layer
        side = self._side(device, "up")
        if ready is not None:
            side.wait_event(ready)
        with torch.cuda.stream(side):
            out = {n: t.to(device, non_blocking=True) for n, t in layer.items()}
        # Note: [the reader's stream waits for this copy only] reads have their own side stream, so a read never
        # queues behind a demotion; the tensors were allocated on the side stream and are used on the current one.
        done = torch.cuda.Event()
        done.record(side)
        current.wait_event(done)
        for t in out.values():
            t.record_stream(current)
        return out

    def _side(self, device: torch.device, direction: str) -> torch.cuda.Stream:
        with self._lock:
            key = (device, direction)
            if key not in self._streams:
                self._streams[key] = torch.cuda.Stream(device)
            return self._streams[key]
