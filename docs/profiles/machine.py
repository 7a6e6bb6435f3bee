"""Profile (not a benchmark): what this CPU gives the model's kernels, to read other profiles' numbers against.

    python docs/profiles/machine.py

2 threads, medians of 30: whether the CPU lists AMX and which kernel ISA torch reports; a SmolLM2-shaped matmul
(1088 x 576 x 1536, the gate/up width) in bf16 and fp32 (GFLOP/s); one of LoRA's rank-16 products at a step's
size (235 x 16 x 1536); a cast copy of a (1024, 3072) fp32 tensor into bf16, as recording does (GB/s moved).
"""

import statistics
import time
from pathlib import Path

import torch

torch.set_num_threads(2)


def median_s(fn, repeats=30):
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
amx = sorted(f for f in flags.split() if f.startswith("amx"))
print(f"AMX flags: {amx or 'none'}; torch CPU capability: {torch.backends.cpu.get_cpu_capability()}")
for dtype in (torch.bfloat16, torch.float32):
    x, w = torch.randn(1088, 576).to(dtype), torch.randn(1536, 576).to(dtype)
    s = median_s(lambda: torch.nn.functional.linear(x, w))  # noqa: B023
    xa, b = torch.randn(235, 16).to(dtype), torch.randn(16, 1536).to(dtype)
    lora = median_s(lambda: xa @ b)  # noqa: B023
    print(f"{str(dtype):15s} 1088x576x1536 matmul {1e3 * s:.3f} ms ({2 * 1088 * 576 * 1536 / s / 1e9:.0f} GFLOP/s); "
          f"235x16x1536 (LoRA up) {1e6 * lora:.0f} us")  # fmt: skip
src, dst = torch.randn(1024, 3072), torch.empty(1024, 3072, dtype=torch.bfloat16)
s = median_s(lambda: dst.copy_(src))
print(f"cast copy fp32 -> bf16 (1024, 3072): {1e3 * s:.2f} ms, {src.numel() * 6 / s / 1e9:.1f} GB/s read + written")
