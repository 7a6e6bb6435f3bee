"""The engine's side of recording: which requests to record, their builders, and handing records to the store.

Policy (``RecordConfig.policy``): "none"; "requested" (requests that ask, ``{"alchemist": {"record": true}}``);
"all"; or "sample" (a ``sample_fraction`` of requests, plus those that ask). A request is recorded during its
prompt's prefill chunks only; when its prompt is complete the record goes to the store under the request id
(the response id that feedback refers to). A preempted request starts its record over with its recomputation.
"""

from __future__ import annotations

import random
from typing import NamedTuple

import torch

from alchemist.activations.record import RecordBuilder, RecordingOps, worth_keeping
from alchemist.activations.store import ActivationStore
from alchemist.config import RecordConfig
from alchemist.model.attention import AttentionMetadata
from alchemist.model.config import ModelConfig
from alchemist.model.seam import Ops


class Chunk(NamedTuple):
    """What ``ops_for`` needs of the sequence behind one segment of a forward."""

    request_id: str
    prompt_ids: list[int]
    recorded: bool  # the recording policy chose it
    requested: bool  # the request asked to be recorded
    adapter_name: str | None  # the adapter serving it (alchemist.engine.sequence)
    adapter_version: int  # that adapter's version serving this forward


class Recorder:
    def __init__(
        self,
        config: RecordConfig,
        store: ActivationStore,
        model_config: ModelConfig,
        device: torch.device | str = "cpu",
        seed: int = 0,
        compute_dtype: torch.dtype | None = None,
    ) -> None:
        self.config = config
        self.store = store
        self.model_config = model_config
        self.device = device
        self.dtype = getattr(torch, config.dtype)
        self.compute_dtype = compute_dtype  # the model's: records in it can keep the forward's outputs
        self._rng = random.Random(seed)
        self._builders: dict[str, RecordBuilder] = {}
        self.num_recorded = 0  # records completed and handed to the store
        self.num_rejected = 0  # completed but refused by the store (no room)
        self.num_adopted = 0  # recorded tensors that are the forward's own outputs (not copies), in completed records

    def wants(self, requested: bool) -> bool:
        """Whether to record a new request, by policy (decided once, when it arrives)."""
        policy = self.config.policy
        if policy == "none":
            return False
        if policy == "all":
            return True
        return requested or (policy == "sample" and self._rng.random() < self.config.sample_fraction)

    def ops_for(
        self,
        meta: AttentionMetadata,
        chunks: list[Chunk],
        inner: Ops,
    ) -> Ops:
        """Recording ops for this forward if any segment is a prompt chunk to record, else ``inner``.

        ``chunks[i]`` describes ``meta.segments[i]``.
        """
        targets: dict[int, RecordBuilder] = {}
        num_rows = sum(seg.length for seg in meta.segments)
        for i, (seg, chunk) in enumerate(zip(meta.segments, chunks, strict=True)):
            request_id, prompt_ids = chunk.request_id, chunk.prompt_ids
            if not chunk.recorded or seg.start >= len(prompt_ids):
                continue  # decode rows, and recomputed outputs after a preemption, are never recorded
            if seg.start == 0:  # a (re)started prefill: a fresh record
                # The whole prompt in this forward, as most of its rows, in the record's dtype: keep the outputs.
                keep = (
                    seg.length >= len(prompt_ids)
                    and worth_keeping(len(prompt_ids), num_rows)
                    and self.dtype == self.compute_dtype
                )
                self._builders[request_id] = RecordBuilder(
                    request_id,
                    prompt_ids,
                    chunk.adapter_version,
                    self.model_config,
                    self.dtype,
                    self.device,
                    chunk.requested,
                    keep_outputs=keep,
                    adapter_name=chunk.adapter_name,
                )
            builder = self._builders.get(request_id)
            if builder is not None:
                targets[i] = builder
        if not targets:
            return inner
        meta.need_lse = True
        return RecordingOps(meta, targets, inner)

    def after_forward(self, ops: Ops) -> None:
        """Closes the chunks just computed; completed records go to the store."""
        if not isinstance(ops, RecordingOps):
            return
        ops.finish()
        for request_id, builder in list(self._builders.items()):
            if builder.is_complete:
                del self._builders[request_id]
                self.num_adopted += builder.num_adopted
                if self.store.put(builder.build()):
                    self.num_recorded += 1
                else:
                    self.num_rejected += 1

    def drop(self, request_id: str) -> None:
        """Forgets a partial record (request aborted before its prompt was done)."""
        self._builders.pop(request_id, None)
