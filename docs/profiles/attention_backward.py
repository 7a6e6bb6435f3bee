"""Profile (not a benchmark): the CPU flash-attention kernels' backward against their forward, and against the
backward from explicit fp32 scores that short sequences take (``alchemist.model.flash.explicit_backward``).

    python docs/profiles/attention_backward.py [THREADS]        # default 2

SmolLM2's attention shape (9 query heads on 3 key/value heads, head dim 64), causal, one sequence of L rows,
medians of 7: the forward (``_scaled_dot_product_flash_attention_for_cpu``), ATen's backward, and the explicit
backward from the same log-sum-exp (with its relative error to ATen's), in bf16 and fp32.
"""

import statistics
import sys
import time

import torch

from alchemist.model import flash as ours

torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
H, HKV, D = 9, 3, 64
SCALE = D**-0.5
flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def median_ms(fn, repeats=7):
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def case(dtype: torch.dtype, length: int) -> None:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, H, length, D, generator=gen).to(dtype)
    k, v = (torch.randn(1, HKV, length, D, generator=gen).to(dtype) for _ in range(2))
    out, lse = flash(q, k, v, 0.0, True, scale=SCALE)[:2]
    do = torch.randn_like(out)
    fwd = median_ms(lambda: flash(q, k, v, 0.0, True, scale=SCALE))
    bwd = median_ms(lambda: flash_backward(do, q, k, v, out, lse, 0.0, True, scale=SCALE))
    mm = median_ms(lambda: ours.explicit_backward(do, q, k, v, out, lse, causal=True, scale=SCALE))
    ref = flash_backward(do, q, k, v, out, lse, 0.0, True, scale=SCALE)
    got = ours.explicit_backward(do, q, k, v, out, lse, causal=True, scale=SCALE)
    rel = [((a.float() - b.view_as(a)).norm() / a.float().norm()).item() for a, b in zip(ref, got, strict=True)]
    err = [f"{e:.1e}" for e in rel]
    print(f"{str(dtype):15s} L={length:5d} forward {fwd:7.2f} ms  flash backward {bwd:7.2f} ms ({bwd / fwd:.1f}x)  "
          f"explicit backward (fp32) {mm:7.2f} ms  rel err dq/dk/dv {err}")  # fmt: skip


for dtype in (torch.bfloat16, torch.float32):
    for length in (32, 85, 128, 160, 236, 512, 1088):
        case(dtype, length)
