"""Profile (not a benchmark): the CPU flash-attention kernels' backward against their forward.

    python docs/profiles/attention_backward.py

SmolLM2's attention shape (9 query heads on 3 key/value heads, head dim 64), causal, one sequence of L rows, 2
threads, medians of 7: the forward (``_scaled_dot_product_flash_attention_for_cpu``), its backward (what recompute's
autograd and replay's walk both run), and a plain-matmul backward in fp32 from the same log-sum-exp (with its
relative error to the kernel's), in bf16 and fp32.
"""

import statistics
import time

import torch

torch.set_num_threads(2)
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


def matmul_backward(do, q, k, v, out, lse, length):
    """dq, dk, dv with the probabilities rebuilt from the lse, heads grouped per key/value head, fp32."""
    g = H // HKV
    qg, dog, og = (t.view(HKV, g, length, D).float() for t in (q, do, out))
    kg, vg = (t.view(HKV, 1, length, D).float() for t in (k, v))
    s = torch.matmul(qg, kg.transpose(-1, -2)) * SCALE
    s.masked_fill_(torch.ones(length, length, dtype=torch.bool).triu(1), float("-inf"))
    prob = torch.exp(s - lse.view(HKV, g, length, 1))
    dv = torch.matmul(prob.transpose(-1, -2), dog).sum(1)
    ds = prob * (torch.matmul(dog, vg.transpose(-1, -2)) - (dog * og).sum(-1, keepdim=True)) * SCALE
    return torch.matmul(ds, kg), torch.matmul(ds.transpose(-1, -2), qg).sum(1), dv


def case(dtype: torch.dtype, length: int) -> None:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, H, length, D, generator=gen).to(dtype)
    k, v = (torch.randn(1, HKV, length, D, generator=gen).to(dtype) for _ in range(2))
    out, lse = flash(q, k, v, 0.0, True, scale=SCALE)[:2]
    do = torch.randn_like(out)
    fwd = median_ms(lambda: flash(q, k, v, 0.0, True, scale=SCALE))
    bwd = median_ms(lambda: flash_backward(do, q, k, v, out, lse, 0.0, True, scale=SCALE))
    mm = median_ms(lambda: matmul_backward(do, q, k, v, out, lse, length))
    ref = flash_backward(do, q, k, v, out, lse, 0.0, True, scale=SCALE)
    got = matmul_backward(do, q, k, v, out, lse, length)
    rel = [((a.float() - b.view_as(a)).norm() / a.float().norm()).item() for a, b in zip(ref, got, strict=True)]
    err = [f"{e:.1e}" for e in rel]
    print(f"{str(dtype):15s} L={length:5d} forward {fwd:6.1f} ms  flash backward {bwd:6.1f} ms ({bwd / fwd:.1f}x)  "
          f"matmul backward (fp32) {mm:6.1f} ms  rel err dq/dk/dv {err}")  # fmt: skip


for dtype in (torch.bfloat16, torch.float32):
    for length in (32, 85, 128, 160, 236, 512, 1088):
        case(dtype, length)
