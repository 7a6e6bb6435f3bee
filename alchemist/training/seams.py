"""What training needs of the rest of the system: two small Protocols, so that it never holds the engine itself.

    trainer = OnlineTrainer.from_config(model, tokenizer, engine, store, log, checkpoints, config)  # engine: publisher
    trainer = Trainer(model, adapter, store)                                                    # store: a RecordSource

The serving engine (``alchemist.engine.LLMEngine``) is an ``AdapterPublisher`` and the activation store
(``alchemist.activations.store.ActivationStore``) a ``RecordSource``; whoever composes the system (the app) builds
both and hands them in. The layering contract (``.importlinter``, run by tests/test_layers.py) keeps training from
importing the engine.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from typing import Protocol

import torch

from alchemist.activations.record import Record
from alchemist.model.lora import LoraAdapter


class AdapterPublisher(Protocol):
    """Where a new adapter version goes to be served: two ways, which differ in who pays for the merge into the
    weights and when the version starts serving (not a sliced and an unsliced twin)."""

    def set_adapter(self, adapter: LoraAdapter | None, version: int) -> None:
        """Serve ``adapter`` (None: the base model, version 0) as ``version`` from the next step, its merge made by
        the serving steps that follow, a layer each (a restore, a rollback: served at once, and no slice of
        training's holds a whole merge). The copy is taken in the call: later changes to ``adapter`` are not
        served."""
        ...

    def set_adapter_slices(self, adapter: LoraAdapter, version: int) -> Generator[None, None, None]:
        """Serve ``adapter`` as ``version`` once its merge is made here, a layer per slice (the stepping thread,
        between engine steps: training's time); the previous version serves until the first step after the last
        slice, so serving never pays for the merge (a batch's new version)."""
        ...


class RecordSource(Protocol):
    """Where a replay finds a prompt's record, by its response id."""

    def lookup(self, record_id: str) -> Record | None:
        """The record, or None. Its layers are read with ``get_layer`` (a record on disk holds only their shapes)."""
        ...

    def pin(self, record_id: str) -> bool:
        """Keeps the record from moving or eviction until ``release``; False if it is not here."""
        ...

    def release(self, record_id: str) -> None: ...

    def tier_of(self, record_id: str) -> str | None:
        """Where the record is read from now ("device", "host" or "disk"); None if it is not here."""
        ...

    def get_layer(self, record_id: str, layer: int, names: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
        """Layer ``layer`` of the record, {name: (num_tokens, width)}, only ``names`` (default: all). Raises
        ``alchemist.activations.store.RecordUnavailable`` if the record went away or its file is damaged."""
        ...
