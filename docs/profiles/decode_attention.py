"""Profile (not a benchmark): the engine's batched decode attention call on CPU, bf16 kernel vs fp32 copies.

    python docs/profiles/decode_attention.py 8 512      # sequences decoding, keys per sequence

SmolLM2's heads (9 query heads on 3 key/value heads, head dim 64), one query per sequence over a strided view of
a cache (as ``alchemist.model.attention._decode_attention`` calls it: additive mask, grouped-query heads), 2
threads, the CLI's memory setting, interleaved medians of 50: ``F.scaled_dot_product_attention`` on the bf16
tensors, the same call on fp32 copies of them (the copies timed too), and the fp32 call on an fp32 cache; with the
largest difference to the bf16 call.
"""

import sys

import torch
import torch.nn.functional as F

from alchemist.bench.report import interleaved_medians
from alchemist.host_memory import keep_freed_memory

assert keep_freed_memory()  # as the server runs: the copies' buffers are reused, not page-faulted in each call
torch.set_num_threads(2)
B, L = int(sys.argv[1]), int(sys.argv[2])
H, HKV, D = 9, 3, 64
SCALE = D**-0.5


def call(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=SCALE, enable_gqa=True)


g = torch.Generator().manual_seed(0)
cache_k, cache_v = (torch.randn(B, HKV, L + 64, D, generator=g) for _ in range(2))  # longer than used: strided views
fp32 = (torch.randn(B, H, 1, D, generator=g), cache_k[:, :, :L], cache_v[:, :, :L], torch.zeros(B, 1, 1, L))
bf16 = tuple(t.to(torch.bfloat16) for t in fp32)
ms = {
    name: 1e3 * seconds
    for name, seconds in interleaved_medians(
        {
            "bf16 call": lambda: call(*bf16),
            "fp32 call on copies": lambda: call(*(t.float() for t in bf16)),
            "fp32 cache": lambda: call(*fp32),
        },
        50,
    ).items()
}
diff = (call(*(t.float() for t in bf16)).to(torch.bfloat16).float() - call(*bf16).float()).abs().max().item()
timings = ", ".join(f"{name} {v:.3f} ms" for name, v in ms.items())
print(f"{B} x {L}: {timings} (copies vs bf16: max |diff| {diff:.2e})")
