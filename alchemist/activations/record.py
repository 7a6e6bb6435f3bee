"""What a serving prefill records for the trainer, and the ops that record it.

Per layer and prompt token (shared/design/activation-reuse.md, sections 2 and 6): the layer input ``h``, the fused
base projection outputs ``qkv`` (before RoPE), ``o``, ``gate_up``, the attention output ``attn`` and its
log-sum-exp ``lse`` (fp32, one per head). Everything else is cheap and recomputed by the replay. The down
projection's output is not recorded, though the design note lists it: it feeds only the residual stream, whose
next value is the next layer's recorded input ``h``, so the walk never reads it; leaving it out takes 9% off a
record's bytes and off the copies that make it (576 of 6,336 values per token and layer for SmolLM2).

``RecordingOps`` computes through an inner ops object (plain, or the engine's packed linears) and hands the rows
of the segments being recorded to each request's ``RecordBuilder``, sliced out of batched, chunked prefills by the
attention metadata. Decode rows are never recorded. A prompt prefilled whole in one forward, in the record's dtype,
is recorded without copying the seam's outputs: its record keeps the tensors the forward computed (nothing modifies
them in place; the trainer only reads them). Otherwise rows are copied into buffers allocated before the forward.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from alchemist.model.attention import AttentionMetadata, Segment, attend
from alchemist.model.config import ModelConfig
from alchemist.model.flash import lse_dtype
from alchemist.model.seam import COMPUTE, Ops

RECORDED = ("h", "qkv", "attn", "lse", "o", "gate_up")
COPIED = ("h",)  # always copied: the layer input is the residual stream, which the forward goes on adding to


def worth_keeping(part: int, whole: int) -> bool:
    """Whether a record keeps a forward's output tensor of which its rows are ``part`` of ``whole`` (rows or
    bytes) rather than copy them out: at least 3/4, so that other requests' rows it holds too stay under a quarter."""
    return 4 * part >= 3 * whole


def record_widths(config: ModelConfig) -> dict[str, int]:
    """Values per token of each recorded tensor, per layer."""
    d, q, kv, i = config.hidden_size, config.q_size, config.kv_size, config.intermediate_size
    return {"h": d, "qkv": q + 2 * kv, "attn": q, "lse": config.num_heads, "o": d, "gate_up": 2 * i}


def record_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    w = record_widths(config)
    per_layer = sum(v for k, v in w.items() if k != "lse") * dtype.itemsize + w["lse"] * 4
    return per_layer * config.num_layers


@dataclass
class Record:
    """A prompt's recorded activations: ``layers[l][name]`` is (num_tokens, width).

    ``requested``: the request asked to be recorded, so feedback on it is likely (the store keeps it longer).
    ``dtype``: the storage dtype of its tensors (the log-sum-exp aside), kept when the store moves the layers out
    (to disk: ``layers`` is then empty).
    """

    record_id: str
    prompt_ids: tuple[int, ...]
    adapter_version: int
    layers: list[dict[str, torch.Tensor]]
    created_s: float = field(default_factory=time.time)
    requested: bool = False
    dtype: torch.dtype | None = None
    adapter_name: str | None = None  # of the adapter version (None: the shared one; alchemist.engine.sequence)

    def __post_init__(self) -> None:
        if self.dtype is None and self.layers and self.layers[0]:
            first = self.layers[0]
            self.dtype = (first["qkv"] if "qkv" in first else next(iter(first.values()))).dtype

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def nbytes(self) -> int:
        """The memory its tensors hold: a tensor kept from the forward that computed it holds that output's whole
        storage, including other requests' rows (``RecordBuilder`` keeps it only if they are under a quarter)."""
        return sum(t.untyped_storage().nbytes() for layer in self.layers for t in layer.values())

    def covers(self, prompt_ids: list[int] | tuple[int, ...], num_rows: int) -> bool:
        """Whether the first ``num_rows`` rows were computed from the same tokens as ``prompt_ids``."""
        return num_rows <= self.num_tokens and tuple(prompt_ids[:num_rows]) == self.prompt_ids[:num_rows]


class RecordBuilder:
    """Per-layer tensors that a prompt's prefill chunks fill, in any number of steps.

    By default every buffer is allocated here, before the forward, and rows are copied in. With ``keep_outputs``
    (the caller expects the whole prompt in one forward, computed in the record's dtype) ``write`` keeps the
    seam's output tensors instead: no copy; only the layer inputs ``h`` are copied. A write it cannot keep
    (another dtype, a tensor mostly made of other requests' rows) is copied into a buffer allocated then.
    Buffers for expected copies are allocated up front, as before keeping existed: allocated between the
    forward's temporaries they measured 0.5-4.5 points slower on a 128-token fp32 prefill
    (``docs/profiles/recording_copies.py 128 31 float32``, ``record_lazy`` vs ``record``), at this machine's noise.
    """

    def __init__(
        self,
        record_id: str,
        prompt_ids: list[int],
        adapter_version: int,
        config: ModelConfig,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
        requested: bool = False,
        keep_outputs: bool = False,
        adapter_name: str | None = None,
    ) -> None:
        self.record_id = record_id
        self.adapter_name = adapter_name
        self.requested = requested
        self.prompt_ids = tuple(prompt_ids)
        self.adapter_version = adapter_version
        self.dtype = dtype
        self.device = torch.device(device)
        self.keep_outputs = keep_outputs
        self._widths = record_widths(config)
        self.layers: list[dict[str, torch.Tensor]] = [{} for _ in range(config.num_layers)]
        for layer in range(config.num_layers):
            for name in self._widths:
                if not keep_outputs or name in COPIED:
                    self._buffer(layer, name)
        self.num_rows_written = 0  # rows 0..num_rows_written-1 are complete in every layer
        self.num_adopted = 0  # tensors kept as the forward computed them (the rest were copied)

    def write(self, layer: int, name: str, start: int, rows: torch.Tensor) -> None:
        """Rows of positions start.. ; positions past the prompt (recomputed outputs after preemption) are dropped."""
        n = len(self.prompt_ids)
        end = min(start + rows.shape[0], n)
        if end <= start:
            return
        rows = rows[: end - start].reshape(end - start, -1)
        if self.keep_outputs and name not in COPIED and start == 0 and end == n and self._adoptable(name, rows):
            self.layers[layer][name] = rows
            self.num_adopted += 1
            return
        self._buffer(layer, name)[start:end] = rows

    def _buffer(self, layer: int, name: str) -> torch.Tensor:
        buffer = self.layers[layer].get(name)
        if buffer is None:
            buffer = torch.empty(len(self.prompt_ids), self._widths[name], dtype=self._dtype(name), device=self.device)
            self.layers[layer][name] = buffer
        return buffer

    def _dtype(self, name: str) -> torch.dtype:
        return lse_dtype(self.dtype) if name == "lse" else self.dtype

    def _adoptable(self, name: str, rows: torch.Tensor) -> bool:
        """Whether the record can keep ``rows`` itself: the stored dtype and device, no graph, dense, and at least
        3/4 of the memory it keeps alive (the rest is other requests' rows of the same forward, which the record's
        size counts). Inference tensors qualify: the trainer only reads records, without autograd (the walk of
        ``alchemist.training.replay`` differentiates by hand)."""
        return (
            rows.dtype == self._dtype(name)
            and rows.device == self.device
            and not rows.requires_grad
            and rows.is_contiguous()
            and worth_keeping(rows.numel() * rows.element_size(), rows.untyped_storage().nbytes())
        )

    def finish_chunk(self, start: int, length: int) -> None:
        if start != self.num_rows_written:
            raise RuntimeError(f"record {self.record_id}: chunk at {start} after {self.num_rows_written} rows")
        self.num_rows_written = min(start + length, len(self.prompt_ids))

    @property
    def is_complete(self) -> bool:
        return self.num_rows_written == len(self.prompt_ids)

    def build(self) -> Record:
        if not self.is_complete:
            raise RuntimeError(f"record {self.record_id} has {self.num_rows_written}/{len(self.prompt_ids)} rows")
        missing = [(i, name) for i, layer in enumerate(self.layers) for name in self._widths if name not in layer]
        if missing:
            raise RuntimeError(f"record {self.record_id}: nothing written for (layer, tensor) {missing[:3]}")
        return Record(
            self.record_id,
            self.prompt_ids,
            self.adapter_version,
            self.layers,
            requested=self.requested,
            dtype=self.dtype,
            adapter_name=self.adapter_name,
        )


class RecordingOps:
    """Computes, and copies the rows of recorded segments into their builders.

    ``targets`` maps the index of a segment in ``meta.segments`` to the builder recording it. The metadata must
    ask for the log-sum-exp (``need_lse=True``); attention is computed here, since it must return it.
    """

    def __init__(self, meta: AttentionMetadata, targets: dict[int, RecordBuilder], inner: Ops = COMPUTE) -> None:
        if not meta.need_lse:
            raise ValueError("recording needs AttentionMetadata(need_lse=True)")
        self._inner = inner  # computes the base projections (e.g. the engine's packed bf16 linears)
        self._targets: list[tuple[Segment, int, RecordBuilder]] = [
            (meta.segments[i], meta.offsets[i], builder) for i, builder in targets.items()
        ]

    def _record(self, layer: int, name: str, values: torch.Tensor) -> None:
        for seg, off, builder in self._targets:
            builder.write(layer, name, seg.start, values[off : off + seg.length])

    def layer_input(self, layer: int, h: torch.Tensor) -> None:
        self._record(layer, "h", h)

    def linear(
        self, layer: int, name: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        y = self._inner.linear(layer, name, x, weight, bias)
        if name in RECORDED:  # not "down"
            self._record(layer, name, y)
        return y

    def attention(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        result = attend(layer, q, k, v, meta)
        self._record(layer, "attn", result.out)
        self._record(layer, "lse", result.lse)
        return result.out

    def finish(self) -> None:
        """Marks the recorded chunks of this forward complete (call after the forward)."""
        for seg, _, builder in self._targets:
            builder.finish_chunk(seg.start, seg.length)
