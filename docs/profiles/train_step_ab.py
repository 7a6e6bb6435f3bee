"""Profile (not a benchmark): ``bench train``'s step functions in one process at one shape, in any dtype.

    python docs/profiles/train_step_ab.py 256 108 5 bfloat16      # P, R, repeats, model and record dtype

``bench train`` runs an fp32 model; this times recompute, prefill and replay with the model and its records in the
given dtype (bf16: what the server runs), interleaved, with torch's default threads, and prints the medians, the
speedup (recompute / replay), the bound (recompute / (recompute - prefill)) and speedup / bound.
"""

import statistics
import sys
import time

import torch

from alchemist.bench.training import make_steps
from alchemist.model.loader import build_model, hf_dir_for

P, R, repeats = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
dtype = getattr(torch, sys.argv[4]) if len(sys.argv) > 4 else torch.float32
steps = make_steps(build_model(hf_dir_for(None), dtype), P, R, dtype)
names = ("recompute", "prefill", "replay")
times: dict[str, list[float]] = {name: [] for name in names}
for name in names:
    steps[name]()  # warm-up
for _ in range(repeats):
    for name in names:
        t0 = time.perf_counter()
        steps[name]()
        times[name].append(time.perf_counter() - t0)
med = {name: statistics.median(v) for name, v in times.items()}
speedup, bound = med["recompute"] / med["replay"], med["recompute"] / (med["recompute"] - med["prefill"])
print(f"P={P} R={R} {dtype} threads={torch.get_num_threads()}", {k: round(v, 3) for k, v in med.items()},
      f"speedup {speedup:.3f} bound {bound:.3f} of_bound {100 * speedup / bound:.1f}%")  # fmt: skip
