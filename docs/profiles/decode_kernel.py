"""Profile (not a benchmark): decode attention for a whole step, our CPU kernel vs ATen's fp32 call on fp32 copies.

    python docs/profiles/decode_kernel.py 32 256     # sequences decoding, keys per sequence

SmolLM2's attention shapes (30 layers, 9 query heads on 3 key/value heads, head dim 64), a bf16 per-slot cache of
each layer as the engine holds it (so the step reads the cache from memory, not from the CPU's caches), 2 threads,
the CLI's memory setting. Interleaved medians of 10 steps: ``torch.ops.alchemist.decode_attention`` (which also
writes the rows' new keys and values) and the path it replaced, ``attention._decode_attention``'s ATen branch (fp32
copies of the slot range, an additive mask, ATen's fp32 SDPA). Prints ms per step and the cache bytes read per
second.
"""

import sys

import torch
import torch.nn.functional as F

from alchemist.bench.report import interleaved_medians
from alchemist.host_memory import keep_freed_memory
from alchemist.model import cpu_kernels
from alchemist.model.attention import KVCache

assert keep_freed_memory()
torch.set_num_threads(2)
B, L = int(sys.argv[1]), int(sys.argv[2])
LAYERS, H, HKV, D = 30, 9, 3, 64
op = cpu_kernels.decode_attention_op()
assert op is not None, "the kernel did not build here"
cache = KVCache(LAYERS, B, L + 16, HKV, D, torch.bfloat16)
for t in (*cache.k, *cache.v):
    t.normal_()
g = torch.Generator().manual_seed(0)
q = torch.randn(B, H, D, generator=g).bfloat16()
k, v = (torch.randn(B, HKV, D, generator=g).bfloat16() for _ in range(2))
slots, positions = torch.arange(B), torch.full((B,), L - 1)
mask = torch.zeros(B, 1, 1, L)


def kernel() -> None:
    for layer in range(LAYERS):
        op(q, k, v, cache.k[layer], cache.v[layer], slots, positions, D**-0.5)


def aten_copies() -> None:
    for layer in range(LAYERS):
        ks, vs = (c[layer][:, :, :L].float() for c in (cache.k, cache.v))
        F.scaled_dot_product_attention(q.float()[:, :, None], ks, vs, attn_mask=mask, enable_gqa=True)


times = interleaved_medians({"kernel": kernel, "aten_fp32_copies": aten_copies}, repeats=10)
cache_bytes = LAYERS * 2 * B * HKV * L * D * 2
for name, s in times.items():
    print(f"{name:18s} {s * 1e3:7.2f} ms per step ({cache_bytes / s / 1e9:5.1f} GB/s of bf16 cache)")
