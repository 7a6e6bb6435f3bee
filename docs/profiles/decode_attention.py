"""Profile (not a benchmark): the engine's batched decode attention call on CPU, bf16 kernel vs fp32 copies.

    python docs/profiles/decode_attention.py 8 512      # sequences decoding, keys per sequence

SmolLM2's heads (9 query heads on 3 key/value heads, head dim 64), one query per sequence over a strided view of
a cache (as ``alchemist.model.attention._decode_attention`` calls it: additive mask, grouped-query heads), 2
threads, medians of 50: ``F.scaled_dot_product_attention`` on the bf16 tensors, the same call on fp32 copies of
them (the copies timed too), and the fp32 call on an fp32 cache; with the largest difference to the bf16 call.
"""

import statistics
import sys
import time

import torch
import torch.nn.functional as F

torch.set_num_threads(2)
B, L = int(sys.argv[1]), int(sys.argv[2])
H, HKV, D = 9, 3, 64
SCALE = D**-0.5


def median_ms(fn, repeats=50):
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def call(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=SCALE, enable_gqa=True)


g = torch.Generator().manual_seed(0)
cache_k, cache_v = (torch.randn(B, HKV, L + 64, D, generator=g) for _ in range(2))  # longer than used: strided views
q32, k32, v32 = torch.randn(B, H, 1, D, generator=g), cache_k[:, :, :L], cache_v[:, :, :L]
mask32 = torch.zeros(B, 1, 1, L)
q, k, v, mask = (t.to(torch.bfloat16) for t in (q32, k32, v32, mask32))
bf16 = call(q, k, v, mask)
upcast = call(*(t.float() for t in (q, k, v, mask))).to(torch.bfloat16)
print(
    f"{B} x {L}: bf16 call {median_ms(lambda: call(q, k, v, mask)):.3f} ms, "
    f"fp32 call on copies {median_ms(lambda: call(*(t.float() for t in (q, k, v, mask)))):.3f} ms "
    f"(max |diff| {(upcast.float() - bf16.float()).abs().max().item():.2e}), "
    f"fp32 cache {median_ms(lambda: call(q32, k32, v32, mask32)):.3f} ms"
)
