"""What a serving prefill records for the trainer, and the ops that record it.

Per layer and prompt token (shared/design/activation-reuse.md, sections 2 and 6): the layer input ``h``, the fused
base projection outputs ``qkv`` (before RoPE), ``o``, ``gate_up``, ``down``, the attention output ``attn`` and
its log-sum-exp ``lse`` (fp32, one per head). Everything else is cheap and recomputed by the replay.

``RecordingOps`` computes through an inner ops object (plain, or the engine's packed linears) and copies the rows
of the segments being recorded into each request's ``RecordBuilder``, sliced out of batched, chunked prefills by
the attention metadata. Decode rows are never copied.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from alchemist.model.attention import AttentionMetadata, Segment, attend, lse_dtype
from alchemist.model.config import ModelConfig
from alchemist.model.seam import COMPUTE, Ops

RECORDED = ("h", "qkv", "attn", "lse", "o", "gate_up", "down")


def record_widths(config: ModelConfig) -> dict[str, int]:
    """Values per token of each recorded tensor, per layer."""
    d, q, kv, i = config.hidden_size, config.q_size, config.kv_size, config.intermediate_size
    return {"h": d, "qkv": q + 2 * kv, "attn": q, "lse": config.num_heads, "o": d, "gate_up": 2 * i, "down": d}


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

    def __post_init__(self) -> None:
        if self.dtype is None and self.layers and self.layers[0]:
            first = self.layers[0]
            self.dtype = (first["qkv"] if "qkv" in first else next(iter(first.values()))).dtype

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers for t in layer.values())

    def covers(self, prompt_ids: list[int] | tuple[int, ...], num_rows: int) -> bool:
        """Whether the first ``num_rows`` rows were computed from the same tokens as ``prompt_ids``."""
        return num_rows <= self.num_tokens and tuple(prompt_ids[:num_rows]) == self.prompt_ids[:num_rows]


class RecordBuilder:
    """Preallocated per-layer buffers that prefill chunks write their rows into, in any number of steps."""

    def __init__(
        self,
        record_id: str,
        prompt_ids: list[int],
        adapter_version: int,
        config: ModelConfig,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
        requested: bool = False,
    ) -> None:
        self.record_id = record_id
        self.requested = requested
        self.prompt_ids = tuple(prompt_ids)
        self.adapter_version = adapter_version
        n = len(prompt_ids)
        widths = record_widths(config)
        # Normal tensors even when built inside the engine's inference mode: the trainer backpropagates
        # through values read from them, which inference tensors forbid.
        with torch.inference_mode(False):
            self.layers = [
                {
                    name: torch.empty(n, width, dtype=lse_dtype(dtype) if name == "lse" else dtype, device=device)
                    for name, width in widths.items()
                }
                for _ in range(config.num_layers)
            ]
        self.num_rows_written = 0  # rows 0..num_rows_written-1 are complete in every layer

    def write(self, layer: int, name: str, start: int, rows: torch.Tensor) -> None:
        """Rows of positions start.. ; positions past the prompt (recomputed outputs after preemption) are dropped."""
        end = min(start + rows.shape[0], len(self.prompt_ids))
        if end > start:
            self.layers[layer][name][start:end] = rows[: end - start].reshape(end - start, -1)

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
        return Record(self.record_id, self.prompt_ids, self.adapter_version, self.layers, requested=self.requested)


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
