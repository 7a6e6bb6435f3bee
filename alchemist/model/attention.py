"""Attention over a flattened batch of sequences, with an optional per-slot KV cache.

A forward pass sees T tokens from several sequences laid end to end (``Segment``s, in token order). Each segment
is either a prefill chunk (its tokens attend causally to the sequence's cached tokens and to each other) or a
decode token (one token of a sequence that already has a cache). Decode tokens are attended in one batched call
over a view of the cache; prefill chunks one call each.

The KV cache keeps each sequence's keys and values contiguous in its slot, ``(num_slots, kv_heads, max_len,
head_dim)``: reading a slot is a view, never a gather. Gathering paged blocks every decode step measured slower on
the target CPU (docs/benchmarks.md, "Paged KV storage"); the block accounting lives in the engine.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple

import torch
import torch.nn.functional as F

from alchemist.model import cpu_kernels, flash
from alchemist.model.cpu_features import cpu_has_amx_bf16
from alchemist.model.flash import lse_dtype


class KVCache:
    """Per-layer key/value storage: ``k[layer]`` and ``v[layer]`` are ``(num_slots, kv_heads, max_len, head_dim)``."""

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        max_len: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (num_slots, num_kv_heads, max_len, head_dim)
        self.k = [_zeros(shape, dtype, device) for _ in range(num_layers)]
        self.v = [_zeros(shape, dtype, device) for _ in range(num_layers)]
        self.num_slots = num_slots
        self.max_len = max_len

    def copy_prefix(self, src: int, dst: int, num_tokens: int) -> None:
        """Every layer's keys/values at positions ``0 .. num_tokens-1`` of slot ``src`` copied into slot ``dst`` (a
        cached prefix that a running sequence holds, for a new sequence: ``alchemist.engine.prefix_cache``)."""
        for k, v in zip(self.k, self.v, strict=True):
            k[dst, :, :num_tokens] = k[src, :, :num_tokens]
            v[dst, :, :num_tokens] = v[src, :, :num_tokens]

    @property
    def bytes_per_token(self) -> int:
        per_layer = self.k[0].element_size() * self.k[0].shape[1] * self.k[0].shape[3] * 2
        return per_layer * len(self.k)


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Zeros; on a CPU in an anonymous memory map, whose pages the kernel zeroes only when first touched, so the cache
    is resident only as far as sequences fill their slots, not for the whole max_num_seqs x max_model_len reservation.
    (Zeros, not garbage: ATen's batched decode call masks positions past a row's length additively, and a NaN there
    would survive the mask.)"""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    # frombuffer keeps the mapping alive as long as the tensor (and its views) are
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8).view(dtype).view(shape)


@dataclass(frozen=True)
class Segment:
    """``length`` new tokens of the sequence in ``slot``, at positions ``start .. start+length-1``."""

    slot: int
    start: int
    length: int

    @property
    def is_decode(self) -> bool:
        return self.length == 1 and self.start > 0


class AttentionResult(NamedTuple):
    out: torch.Tensor  # (T, H, D)
    lse: torch.Tensor | None  # (T, H) fp32 (fp64 for fp64) log-sum-exp of each row's scores, when asked for


@dataclass
class AttentionMetadata:
    """Which rows of the flattened batch belong to which sequence, and where they attend.

    Built once per forward and shared by all layers (it caches the decode mask and index tensors).
    Without a cache, every segment must start at 0 and attends only to its own tokens.
    """

    segments: list[Segment]
    cache: KVCache | None = None
    need_lse: bool = False
    scale: float | None = None
    offsets: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.offsets = []
        total = 0
        for seg in self.segments:
            if seg.length <= 0:
                raise ValueError(f"segment {seg} has no tokens")
            if self.cache is None and seg.start:
                raise ValueError(f"segment {seg} continues a sequence but there is no KV cache")
            if self.cache is not None and seg.start + seg.length > self.cache.max_len:
                raise ValueError(f"segment {seg} overflows the cache length {self.cache.max_len}")
            self.offsets.append(total)
            total += seg.length
        self.num_tokens = total
        self.max_position = max(s.start + s.length for s in self.segments) - 1

    @classmethod
    def single(cls, length: int, need_lse: bool = False) -> AttentionMetadata:
        """One sequence, no cache: a plain causal forward (tests, training)."""
        return cls([Segment(slot=0, start=0, length=length)], need_lse=need_lse)

    @cached_property
    def decode_rows(self) -> list[int]:
        return [off for seg, off in zip(self.segments, self.offsets, strict=True) if seg.is_decode]

    @property
    def all_decode(self) -> bool:
        return len(self.decode_rows) == len(self.segments)

    @cached_property
    def decode_segments(self) -> list[Segment]:
        return [s for s in self.segments if s.is_decode]

    @cached_property
    def decode_index(self) -> slice | list[int]:
        """``decode_rows`` as a slice where they are consecutive (the scheduler puts decodes first), which
        indexes without a gather."""
        rows = self.decode_rows
        if rows == list(range(rows[0], rows[0] + len(rows))):
            return slice(rows[0], rows[0] + len(rows))
        return rows

    @cached_property
    def decode_by_kernel(self) -> bool:
        """Decode rows run our CPU kernel, which also writes their keys and values (``decode_kernel_applies``)."""
        return self.cache is not None and bool(self.decode_rows) and decode_kernel_applies(self.cache.k[0])

    @cached_property
    def _decode(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The decode rows' slots, positions and lengths (position + 1), each (N,) int64."""
        assert self.cache is not None
        device = self.cache.k[0].device
        segs = self.decode_segments
        slots = torch.tensor([s.slot for s in segs], device=device)
        positions = torch.tensor([s.start for s in segs], device=device)
        return slots, positions, positions + 1

    @cached_property
    def _decode_mask(self) -> tuple[torch.Tensor, int, int]:
        """The additive mask (in the call's dtype, ``decode_dtype``) for ATen's batched decode call over slots
        ``lo .. hi``, with lo and the longest length."""
        assert self.cache is not None
        slots, positions, _ = self._decode
        device = slots.device
        segs = self.decode_segments
        lo = min(s.slot for s in segs)
        hi = max(s.slot for s in segs) + 1
        max_len = max(s.start for s in segs) + 1
        # Slots in lo..hi that are not decoding now get length 1: their rows are computed and dropped
        # (no fully masked rows; what they read may be unwritten memory). The engine keeps live slots compact so
        # such holes are rare.
        lengths = torch.ones(hi - lo, dtype=torch.long, device=device)
        lengths[slots - lo] = positions + 1
        allowed = torch.arange(max_len, device=device)[None, :] < lengths[:, None]
        mask = torch.zeros(allowed.shape, dtype=decode_dtype(self.cache.k[0]), device=device)
        mask.masked_fill_(~allowed, float("-inf"))
        return mask[:, None, None, :], lo, max_len


def bottom_right_causal_mask(num_q: int, num_k: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Additive mask where query i (the i-th of the last ``num_q`` positions) sees keys ``0 .. num_k-num_q+i``.

    With fewer queries than keys, SDPA's ``is_causal=True`` aligns top-left, which is wrong here.
    """
    i = torch.arange(num_q, device=device)[:, None]
    j = torch.arange(num_k, device=device)[None, :]
    mask = torch.zeros(num_q, num_k, dtype=dtype, device=device)
    return mask.masked_fill_(j > i + (num_k - num_q), float("-inf"))


def sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    is_causal: bool,
    mask: torch.Tensor | None,
    scale: float,
    need_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(B, H, L, D) attention; grouped-query heads need no repeat. Returns the fp32 lse when asked."""
    if need_lse:
        return flash.forward(q, k, v, causal=is_causal, scale=scale, mask=mask)
    if q.device.type == "cpu" and is_causal and mask is None and torch.is_grad_enabled() and q.requires_grad:
        return flash.Attention.apply(q, k, v, scale), None  # a training forward: its backward is ours
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )
    return out, None


def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> AttentionResult:
    """q: (T, H, D), k and v: (T, Hkv, D), RoPE applied. Writes k/v into the cache, returns (T, H, D)."""
    scale = meta.scale if meta.scale is not None else q.shape[-1] ** -0.5
    cache = meta.cache
    if cache is not None:
        _write_cache(layer, k, v, meta)
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=lse_dtype(q.dtype), device=q.device) if meta.need_lse else None
    for seg, off in zip(meta.segments, meta.offsets, strict=True):
        if seg.is_decode:
            continue
        rows = slice(off, off + seg.length)
        qs = q[rows].transpose(0, 1).unsqueeze(0)
        if cache is None:
            ks, vs = (t[rows].transpose(0, 1).unsqueeze(0) for t in (k, v))
        else:
            end = seg.start + seg.length
            ks, vs = cache.k[layer][seg.slot, :, :end].unsqueeze(0), cache.v[layer][seg.slot, :, :end].unsqueeze(0)
        mask = None
        if seg.start:
            mask = bottom_right_causal_mask(seg.length, seg.start + seg.length, q.dtype, q.device)
        o, row_lse = sdpa(qs, ks, vs, is_causal=not seg.start, mask=mask, scale=scale, need_lse=meta.need_lse)
        out[rows] = o[0].transpose(0, 1)
        if lse is not None:
            lse[rows] = row_lse[0].transpose(0, 1)
    if meta.decode_rows:
        _decode_attention(layer, q, k, v, out, meta, scale)
    return AttentionResult(out, lse)


def _write_cache(layer: int, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
    cache = meta.cache
    assert cache is not None
    for seg, off in zip(meta.segments, meta.offsets, strict=True):
        if seg.is_decode:
            continue
        dst = slice(seg.start, seg.start + seg.length)
        cache.k[layer][seg.slot, :, dst] = k[off : off + seg.length].transpose(0, 1)
        cache.v[layer][seg.slot, :, dst] = v[off : off + seg.length].transpose(0, 1)
    if meta.decode_rows and not meta.decode_by_kernel:  # the kernel writes its rows itself
        slots, positions, _ = meta._decode
        rows = meta.decode_index
        cache.k[layer][slots, :, positions] = k[rows]
        cache.v[layer][slots, :, positions] = v[rows]


def decode_dtype(cache: torch.Tensor) -> torch.dtype:
    """The dtype of ATen's batched decode call over a cache of this dtype and device: fp32 on a CPU without AMX, where
    ATen's bf16 flash kernel ran one query per sequence several times slower than its fp32 kernel on fp32 copies, the
    copies included (docs/benchmarks.md, "Decode attention in bf16 without AMX"; it accumulates in fp32 either way);
    else the cache's own."""
    return torch.float32 if cache.device.type == "cpu" and not cpu_has_amx_bf16() else cache.dtype


def decode_kernel_applies(cache: torch.Tensor) -> bool:
    """Whether decode attention over this cache runs our CPU kernel (``csrc/decode_attention.cpp``): a bf16 cache
    on a CPU without AMX, where ATen's call needs fp32 copies of the cache (``decode_dtype``), if the kernel builds.
    Reading the bf16 cache in place makes a step's decode attention several times faster than those copies
    (docs/benchmarks.md, "Decode step")."""
    return (
        cache.device.type == "cpu"
        and cache.dtype == torch.bfloat16
        and decode_dtype(cache) != cache.dtype
        and cpu_kernels.decode_attention_op() is not None
    )


def _decode_attention(
    layer: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> None:
    """All decode tokens in one call: our kernel, which writes the rows' keys and values into the cache and attends
    over the bf16 cache in place (``decode_kernel_applies``), else ATen's over the cache view of slots lo .. hi
    (the keys and values written already; no copy of the cache, unless the call runs in another dtype:
    ``decode_dtype``)."""
    cache = meta.cache
    assert cache is not None
    rows = meta.decode_index
    slots, positions, _ = meta._decode
    k_cache, v_cache = cache.k[layer], cache.v[layer]
    if meta.decode_by_kernel:
        op = cpu_kernels.decode_attention_op()
        out[rows] = op(q[rows], k[rows], v[rows], k_cache, v_cache, slots, positions, scale)
        return
    mask, lo, max_len = meta._decode_mask
    span, ct = mask.shape[0], mask.dtype
    q_span = q.new_zeros(span, q.shape[1], 1, q.shape[2], dtype=ct)
    q_span[slots - lo] = q[rows].unsqueeze(2).to(ct)
    ks = k_cache[lo : lo + span, :, :max_len].to(ct)
    vs = v_cache[lo : lo + span, :, :max_len].to(ct)
    o, _ = sdpa(q_span, ks, vs, is_causal=False, mask=mask, scale=scale, need_lse=False)
    out[rows] = o[slots - lo, :, 0].to(out.dtype)
