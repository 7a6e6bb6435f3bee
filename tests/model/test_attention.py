"""Cached, chunked and batched attention equals one plain causal forward of each sequence alone."""

from __future__ import annotations

import pytest
import torch

from alchemist.model import attention
from alchemist.model.attention import AttentionMetadata, KVCache, Segment, attend
from alchemist.model.loader import build_model


def _alone(model, ids):
    meta = AttentionMetadata.single(len(ids))
    return model.logits(model(ids, torch.arange(len(ids)), meta))


def test_chunked_prefill_and_batched_decode_match_alone(tiny_dirs):
    model = build_model(tiny_dirs["llama-gqa-untied"], torch.float32)
    c = model.config
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, c.vocab_size, (n,), generator=g) for n in (53, 12, 26)]
    cache = KVCache(c.num_layers, 4, 128, c.num_kv_heads, c.head_dim, torch.float32)
    slots = [0, 2, 3]  # a hole at slot 1: its decode row must be computed and dropped harmlessly
    got = [[] for _ in seqs]
    with torch.no_grad():
        # Step 1: first chunks of the prefills, side by side in one batch.
        chunks = [(0, 30), (1, 8), (2, 22)]
        _step(model, cache, seqs, slots, [(i, 0, n) for i, n in chunks], got)
        # Step 2: the rest of sequence 0's prompt (a continued chunk) next to decode steps of 1 and 2
        # (teacher-forced: the "decoded" token is the sequence's next token, so the alone forward is the oracle).
        _step(model, cache, seqs, slots, [(0, 30, 20), (1, 8, 1), (2, 22, 1)], got)
        for t in range(3):  # Steps 3-5: all three decode together.
            _step(model, cache, seqs, slots, [(0, 50 + t, 1), (1, 9 + t, 1), (2, 23 + t, 1)], got)
    with torch.no_grad():
        for i, seq in enumerate(seqs):
            expected = _alone(model, seq)
            rows = torch.cat(got[i])
            assert (rows - expected[-len(rows) :]).abs().max().item() <= 1e-5


def _step(model, cache, seqs, slots, parts, got):
    """parts: (sequence index, start, length); for a decode part the token at ``start`` is fed alone."""
    segs, ids, pos = [], [], []
    for i, start, n in parts:
        segs.append(Segment(slot=slots[i], start=start, length=n))
        ids.append(seqs[i][start : start + n])
        pos.append(torch.arange(start, start + n))
    meta = AttentionMetadata(segs, cache=cache)
    logits = model.logits(model(torch.cat(ids), torch.cat(pos), meta))
    off = 0
    for i, _, n in parts:
        got[i].append(logits[off : off + n])
        off += n


@pytest.mark.parametrize("kernel", [True, False])
def test_bf16_batched_decode_attention_is_the_attention_of_its_cached_values(kernel, monkeypatch):
    """In bf16 the CPU decode call runs our kernel over the cache in place (``kernel``; where it applies) or ATen's
    on fp32 copies of the cache (ATen's bf16 kernel is several times slower): each sequence's decode row is the
    softmax attention of its own cached bf16 keys and values (computed here in fp64), rounded once to bf16;
    grouped-query heads, a hole in the slots, different lengths."""
    if not kernel:
        monkeypatch.setattr(attention, "decode_kernel_applies", lambda cache: False)
    heads, kv_heads, dim = 6, 2, 16
    lengths, slots = [37, 5, 20], [0, 2, 3]
    placed = list(zip(slots, lengths, strict=True))
    g = torch.Generator().manual_seed(0)
    cache = KVCache(1, 4, 64, kv_heads, dim, torch.bfloat16)
    keys = [torch.randn(n + 1, kv_heads, dim, generator=g).bfloat16() for n in lengths]
    values = [torch.randn(n + 1, kv_heads, dim, generator=g).bfloat16() for n in lengths]
    prefill = AttentionMetadata([Segment(slot=s, start=0, length=n) for s, n in placed], cache=cache)
    q = torch.randn(sum(lengths), heads, dim, generator=g).bfloat16()
    attend(0, q, torch.cat([k[:-1] for k in keys]), torch.cat([v[:-1] for v in values]), prefill)
    decode = AttentionMetadata([Segment(slot=s, start=n, length=1) for s, n in placed], cache=cache)
    q = torch.randn(len(lengths), heads, dim, generator=g).bfloat16()
    out = attend(0, q, torch.cat([k[-1:] for k in keys]), torch.cat([v[-1:] for v in values]), decode).out
    assert out.dtype == torch.bfloat16
    assert decode.decode_by_kernel == (kernel and attention.decode_kernel_applies(cache.k[0]))
    for i in range(len(lengths)):
        k, v = (t.double().repeat_interleave(heads // kv_heads, dim=1) for t in (keys[i], values[i]))
        probs = (torch.einsum("hd,khd->hk", q[i].double(), k) * dim**-0.5).softmax(-1)
        expected = torch.einsum("hk,khd->hd", probs, v)
        assert torch.allclose(out[i].double(), expected, rtol=8e-3, atol=8e-3), (out[i].double() - expected).abs().max()
