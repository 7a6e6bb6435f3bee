"""Profile (not a benchmark): replay from memory vs from disk with the prefetch window (depth 2) vs synchronous
reads (depth 0), page cache warm, in one process; wall and process CPU time, medians of 3 interleaved steps.

    python docs/profiles/disk_prefetch_ab.py 1024 128
"""

import statistics
import sys
import time

import torch

from alchemist.bench.memory_steps import StepSet
from alchemist.model.loader import build_model, hf_dir_for

P, R = int(sys.argv[1]), int(sys.argv[2])
model = build_model(hf_dir_for(None), torch.float32)
sets = {d: StepSet(model, P, R, ("replay_memory", "replay_disk"), torch.bfloat16, prefetch_depth=d) for d in (2, 0)}
modes = {
    "memory": sets[2]["replay_memory"],
    "disk_depth2": sets[2]["replay_disk"],
    "disk_depth0": sets[0]["replay_disk"],
}
for step in modes.values():
    step()  # warm-up: the file is in the page cache from here on
wall: dict[str, list[float]] = {name: [] for name in modes}
cpu: dict[str, list[float]] = {name: [] for name in modes}
for _ in range(3):
    for name, step in modes.items():
        w, c = time.perf_counter(), time.process_time()
        step()
        wall[name].append(time.perf_counter() - w)
        cpu[name].append(time.process_time() - c)
for name in modes:
    print(f"{name}: wall {statistics.median(wall[name]):.3f} s, cpu {statistics.median(cpu[name]):.3f} s")
for s in sets.values():
    s.close()
