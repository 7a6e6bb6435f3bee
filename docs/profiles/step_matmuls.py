"""Profile (not a benchmark): the matmuls of one recompute step and one replay step, by shape (torch.profiler).

    python docs/profiles/step_matmuls.py 128 108 bfloat16      # P, R, model and record dtype

``bench train``'s step functions on SmolLM2, 2 threads, 2 warm-up steps then 3 profiled; per step: the total time
in matmuls, and per shape the time, the calls and the time per call (shapes over 1.5 ms per step).
"""

import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from alchemist.bench.training import make_steps
from alchemist.model.loader import build_model, hf_dir_for

torch.set_num_threads(2)
P, R = int(sys.argv[1]), int(sys.argv[2])
dtype = getattr(torch, sys.argv[3]) if len(sys.argv) > 3 else torch.float32
steps = make_steps(build_model(hf_dir_for(None), dtype), P, R, dtype)
for name in ("recompute", "replay"):
    for _ in range(2):
        steps[name]()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as p:
        for _ in range(3):
            steps[name]()
    by_shape: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0])
    for e in p.key_averages(group_by_input_shape=True):
        if e.key in ("aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm"):
            row = by_shape[e.key, str(e.input_shapes[:2])]
            row[0] += e.self_cpu_time_total / 3e3
            row[1] += e.count // 3
    print(f"{name}: matmuls {sum(ms for ms, _ in by_shape.values()):.1f} ms per step")
    for (op, shapes), (ms, calls) in sorted(by_shape.items(), key=lambda kv: -kv[1][0]):
        if ms > 1.5:
            print(f"  {op:12s} {shapes:45s} {ms:7.1f} ms {calls:5d} calls {1e3 * ms / max(calls, 1):8.1f} us/call")
