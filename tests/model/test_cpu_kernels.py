"""Our CPU kernels. Decode attention (``alchemist/model/csrc/decode_attention.cpp``) against fp64 attention of the
same cached values: bf16 and fp32 caches, head dims that take the AVX-512 path (multiples of 16) and the scalar one
(8), grouped and plain heads, lengths from 1 to several hundred, rows in arbitrary slots. The packed linear op
(``csrc/packed_linear.cpp``) against oneDNN's, bitwise."""

from __future__ import annotations

import pytest
import torch

from alchemist.model import cpu_kernels


def _reference(q, k_cache, v_cache, slots, lengths, scale):
    """fp64 softmax attention of each row over its slot's first ``lengths`` cached keys and values."""
    out = []
    heads, kv_heads = q.shape[1], k_cache.shape[1]
    for i, (slot, n) in enumerate(zip(slots.tolist(), lengths.tolist(), strict=True)):
        k = k_cache[slot, :, :n].double().repeat_interleave(heads // kv_heads, dim=0)  # (H, n, D)
        v = v_cache[slot, :, :n].double().repeat_interleave(heads // kv_heads, dim=0)
        probs = (torch.einsum("hd,hnd->hn", q[i].double(), k) * scale).softmax(-1)
        out.append(torch.einsum("hn,hnd->hd", probs, v))
    return torch.stack(out)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 4, 16), (6, 2, 8), (8, 1, 128)])
def test_decode_attention_kernel_is_the_attention_of_the_cached_values(dtype, heads, kv_heads, dim):
    op = cpu_kernels.decode_attention_op()
    assert op is not None, "the kernel must build on the machines CI runs on"
    g = torch.Generator().manual_seed(heads * dim)
    num_slots, max_len = 6, 320
    k_cache = torch.randn(num_slots, kv_heads, max_len, dim, generator=g).to(dtype)
    v_cache = torch.randn(num_slots, kv_heads, max_len, dim, generator=g).to(dtype)
    slots = torch.tensor([4, 0, 5, 2])
    positions = torch.tensor([0, 16, 319, 202])
    q = (torch.randn(4, heads, dim, generator=g) * 2).to(dtype)  # * 2: peaked softmaxes too
    k = torch.randn(4, kv_heads, dim, generator=g).to(dtype)
    v = torch.randn(4, kv_heads, dim, generator=g).to(dtype)
    untouched = k_cache.clone(), v_cache.clone()
    scale = dim**-0.5
    out = op(q, k, v, k_cache, v_cache, slots, positions, scale)
    assert out.dtype == dtype and out.shape == q.shape
    # the new rows were written at their positions, nothing else
    for before, after, new in ((untouched[0], k_cache, k), (untouched[1], v_cache, v)):
        assert torch.equal(after[slots, :, positions], new)
        after[slots, :, positions] = before[slots, :, positions]
        assert torch.equal(after, before)
        after[slots, :, positions] = new
    expected = _reference(q, k_cache, v_cache, slots, positions + 1, scale)
    # fp32: a few fp32 roundings of the sums; bf16: the output's one rounding to bf16 (2^-8 relative)
    tol = 4e-3 if dtype == torch.bfloat16 else 2e-6
    assert torch.allclose(out.double(), expected, rtol=tol, atol=tol), (out.double() - expected).abs().max()


def test_decode_attention_kernel_rejects_what_it_cannot_read():
    op = cpu_kernels.decode_attention_op()
    cache = torch.zeros(2, 1, 8, 16)
    q, kv = torch.zeros(1, 2, 16), torch.zeros(1, 1, 16)
    with pytest.raises(RuntimeError, match="position out of range"):
        op(q, kv, kv, cache, cache.clone(), torch.tensor([0]), torch.tensor([8]), 1.0)
    with pytest.raises(RuntimeError, match="slot out of range"):
        op(q, kv, kv, cache, cache.clone(), torch.tensor([2]), torch.tensor([1]), 1.0)
    with pytest.raises(RuntimeError, match="share a dtype"):
        op(q.bfloat16(), kv, kv, cache, cache.clone(), torch.tensor([0]), torch.tensor([1]), 1.0)


@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_op_is_onednns_packed_linear(bias):
    from alchemist.engine.packed_ops import onednn_packs_bf16, pack, packed_linear

    op = cpu_kernels.packed_linear_op()
    assert op is not None, "the kernels must build on the machines CI runs on"
    assert onednn_packs_bf16(), "the machines CI runs on (AVX-512) pack bf16 weights"
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 64, generator=g).to(torch.bfloat16)
    b = torch.randn(96, generator=g).to(torch.bfloat16) if bias else None
    x = torch.randn(5, 64, generator=g).to(torch.bfloat16)
    packed = pack(w)
    assert torch.equal(op(x, packed, b, 96), packed_linear(x, packed, b))
