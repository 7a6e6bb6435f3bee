"""AdapterRegistry: the named LoRA adapters served (vLLM's multi-LoRA), more of them than the engine holds at once.

    registry = AdapterRegistry(engine, max_loras=4, max_cpu_loras=8, reserved=["smollm2"])
    registry.register("team-a", "/adapters/team-a")          # start-up: read and checked now (ValueError)
    await registry.load("team-b", "/adapters/team-b")         # at run time, the read off the event loop
    await registry.acquire("team-a")                          # on the event loop: in the engine, held there ...
    stream = async_engine.generate(..., adapter_name="team-a", on_finish=lambda: registry.release("team-a"))
    registry.unload("team-b")                                 # requests in flight finish with it

Every registered adapter is a PEFT adapter directory (``alchemist.model.peft_format``) on disk. At most
``max_loras`` are in the engine (``LLMEngine.set_adapter(..., name=)``); a request for another waits in ``acquire``
until a slot is free: the least recently used adapter that no request holds is evicted (``remove_adapter``) and the
one asked for paged in. When every slot is held by requests in flight, ``acquire`` waits for a release rather than
failing. The last ``max_cpu_loras`` adapters read are kept in memory, so a page-in after an eviction need not read
the disk again. Loads, evictions and disk reads are counted (the server's /metrics shows them).

Each registration gets a version of its own (the engine's prefix cache is keyed by adapter name and version): a
page-in serves the same weights under the same version, so cached prompt blocks stay valid across evictions, while a
name unloaded and loaded again from another directory never meets the old one's blocks.

A trained adapter (one with an online trainer of its own, ``alchemist.runtime.trainers``: those given at start,
``trained``, and those ``load``ed with ``train``) is not paged: its trainer sets its versions in the engine, where
it stays, outside the ``max_loras`` slots (a page-in from its directory would serve the weights as loaded, not as
trained). It cannot be unloaded (its trainer would set it again). The others are served frozen.

Threads: ``register`` before the event loop runs; everything else on the event loop thread (no locks: state only
changes between awaits). The disk read runs in a worker thread; the engine's copy of a page-in (``set_adapter``) is
taken on the event loop thread: a few MiB, like the copies ``set_adapter`` takes for the trainer.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Container, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from alchemist.config.server import ADAPTER_NAME
from alchemist.engine import LLMEngine
from alchemist.engine.sequence import BASE
from alchemist.model.lora import LoraAdapter
from alchemist.model.peft_format import load_adapter


@dataclass
class _Entry:
    path: Path
    version: int  # the engine version of this registration (see the module doc)
    in_engine: bool = False  # set in the engine, or being paged in (a slot either way)
    loading: bool = False
    users: int = 0  # requests holding it, from acquire to release: it is not evicted while any does


class AdapterRegistry:
    def __init__(self, engine: LLMEngine, max_loras: int = 4, max_cpu_loras: int | None = None,
                 reserved: Iterable[str] = (), trained: Container[str] = ()) -> None:  # fmt: skip
        if max_loras < 1:
            raise ValueError(f"max_loras must be >= 1 (got {max_loras})")
        if max_cpu_loras is not None and max_cpu_loras < max_loras:
            raise ValueError(f"max_cpu_loras ({max_cpu_loras}) must be >= max_loras ({max_loras})")
        self.engine = engine
        self.max_loras = max_loras
        self.max_cpu_loras = max_cpu_loras if max_cpu_loras is not None else max_loras
        self.reserved = {BASE, *reserved}  # names no adapter may take: the base model's
        self.trained = trained  # names whose trainers keep them in the engine (register: not paged)
        self._entries: dict[str, _Entry] = {}
        self._slots: OrderedDict[str, None] = OrderedDict()  # adapters in the engine, least recently used first
        self._cpu: OrderedDict[str, LoraAdapter] = OrderedDict()  # adapters read, least recently used first
        self._changed = asyncio.Event()  # replaced on every change; waiters wait on the one they saw
        self._next_version = 1
        self.num_loads = 0  # page-ins into the engine
        self.num_evictions = 0  # page-outs to make room
        self.num_disk_reads = 0

    # --- registration -------------------------------------------------------------------------------------------

    def register(self, name: str, path: str | Path) -> None:
        """Registers the adapter directory ``path`` under ``name``, reading it now; ValueError if the name is taken
        or invalid, or the directory is not a PEFT LoRA adapter this model can serve."""
        self._check_name(name)
        adapter = self._read(Path(path))
        if name in self.trained:  # in the engine already, set there by its trainer
            self._add_trained(name, Path(path))
            return
        self._add(name, Path(path), adapter)

    async def load(
        self, name: str, path: str | Path, train: Callable[[str, LoraAdapter], Awaitable[None]] | None = None
    ) -> None:
        """``register`` at run time: the directory is read in a worker thread. With ``train``, awaited with the
        adapter read, its trainer is started first (``alchemist.runtime.trainers``), which sets it in the engine:
        it is then served as trained (not paged); its errors (ValueError) are the load's."""
        self._check_name(name)
        adapter = await asyncio.to_thread(self._read, Path(path))
        self._check_name(name)  # another load of the name may have finished meanwhile
        if train is None:
            self._add(name, Path(path), adapter)
            return
        await train(name, adapter)
        self._add_trained(name, Path(path))

    def unload(self, name: str) -> None:
        """Forgets ``name`` (KeyError if unknown; ValueError if trained) and takes it out of the engine: requests
        in flight finish with it, later ones naming it are refused."""
        if name in self.trained and name in self._entries:
            raise ValueError(f"adapter {name!r} is trained online here: it cannot be unloaded (its trainer serves it)")
        entry = self._entries.pop(name)
        self._cpu.pop(name, None)
        if self._slots.pop(name, "absent") is None and not entry.loading:
            self.engine.remove_adapter(name)
        self._notify()

    def paths(self) -> dict[str, Path]:
        """Every registered adapter's directory, by name."""
        return {name: entry.path for name, entry in self._entries.items()}

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    @property
    def num_in_engine(self) -> int:
        return len(self._slots)

    def residence(self, name: str) -> Literal["engine", "memory", "disk"]:
        """Where ``name``'s weights are now (KeyError if not registered): "engine" (a request is served without a
        wait; a trained adapter always), "memory" (kept read: a page-in without a disk read), else "disk"."""
        entry = self._entries[name]
        if entry.in_engine and not entry.loading:
            return "engine"
        return "memory" if name in self._cpu else "disk"

    # --- serving ------------------------------------------------------------------------------------------------

    async def acquire(self, name: str) -> None:
        """Returns once ``name`` is in the engine, held there until ``release(name)``: paged in if needed, evicting
        the least recently used idle adapter; waits while every slot is held. KeyError if ``name`` is not (or no
        longer) registered."""
        while True:
            entry = self._entries.get(name)
            if entry is None:
                raise KeyError(name)
            if entry.in_engine and not entry.loading:
                entry.users += 1
                if name in self._slots:  # a trained adapter holds no slot
                    self._slots.move_to_end(name)
                return
            if not entry.in_engine and self._make_room():
                await self._page_in(name, entry)
                return
            await self._changed.wait()  # a load finished, a request released its adapter, or one was unloaded

    def release(self, name: str) -> None:
        """A request that ``acquire``d ``name`` is done with it (finished or aborted)."""
        entry = self._entries.get(name)
        if entry is not None:  # else unloaded meanwhile
            entry.users -= 1
            self._notify()

    # --- internals ----------------------------------------------------------------------------------------------

    def _check_name(self, name: str) -> None:
        if not isinstance(name, str) or not ADAPTER_NAME.fullmatch(name):
            raise ValueError(f"adapter name {name!r}: use 1 to 128 letters, digits and _ . @ : / - only")
        if name in self.reserved:
            raise ValueError(f"adapter name {name!r} is the base model's; choose another")
        if name in self._entries:
            raise ValueError(f"an adapter named {name!r} is loaded already (unload it first to replace it)")

    def _read(self, path: Path) -> LoraAdapter:
        """The adapter in ``path`` (blocking: a worker thread at run time); ValueError naming the problem."""
        if not path.is_dir():
            raise ValueError(f"{path}: not a directory (expected a PEFT LoRA adapter directory)")
        adapter = load_adapter(path, self.engine.model.config)
        self.num_disk_reads += 1
        return adapter

    def _add(self, name: str, path: Path, adapter: LoraAdapter) -> None:
        self._entries[name] = _Entry(path, self._next_version)
        self._next_version += 1
        self._keep(name, adapter)
        self._notify()

    def _add_trained(self, name: str, path: Path) -> None:
        self._entries[name] = _Entry(path, 0, in_engine=True)  # its version is its trainer's, set in the engine
        self._notify()

    def _keep(self, name: str, adapter: LoraAdapter) -> None:
        self._cpu[name] = adapter
        self._cpu.move_to_end(name)
        while len(self._cpu) > self.max_cpu_loras:
            self._cpu.popitem(last=False)

    def _make_room(self) -> bool:
        """Whether a slot is free for one more adapter, evicting the least recently used idle one if none is."""
        if len(self._slots) < self.max_loras:
            return True
        for name in self._slots:  # least recently used first
            entry = self._entries[name]
            if entry.users == 0 and not entry.loading:
                del self._slots[name]
                entry.in_engine = False
                self.engine.remove_adapter(name)
                self.num_evictions += 1
                return True
        return False

    async def _page_in(self, name: str, entry: _Entry) -> None:
        """Takes a slot for ``name`` and sets it in the engine, held by the caller (``users`` 1)."""
        entry.in_engine = entry.loading = True
        entry.users += 1
        self._slots[name] = None
        try:
            adapter = self._cpu.get(name)
            if adapter is None:
                adapter = await asyncio.to_thread(self._read, entry.path)
            if self._entries.get(name) is not entry:  # unloaded while it was read
                raise KeyError(name)
            self._keep(name, adapter)
            self.engine.set_adapter(adapter, entry.version, name=name)
        except BaseException:
            entry.in_engine = entry.loading = False
            entry.users -= 1
            if self._entries.get(name) is entry:
                self._slots.pop(name, None)
            self._notify()
            raise
        entry.loading = False
        self.num_loads += 1
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()
