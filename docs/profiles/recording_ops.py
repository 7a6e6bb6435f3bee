"""Profile (not a benchmark): where a recording prefill's extra time goes, op by op, against a plain prefill.

    python docs/profiles/recording_ops.py 1024 bfloat16     # prompt tokens, model dtype (records in bf16)

``bench train``'s prefill step functions (SmolLM2, LoRA on), the CLI's memory setting, 2 threads, two warm-ups;
each prefill 3 times under torch.profiler: per op, the median self CPU time and the call count of each, sorted by
how much more the recording prefill spent.
"""

import statistics
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from alchemist.bench.training import make_steps
from alchemist.host_memory import keep_freed_memory
from alchemist.model.loader import build_model, hf_dir_for

num_prompt, dtype = int(sys.argv[1]), getattr(torch, sys.argv[2])
assert keep_freed_memory()
torch.set_num_threads(2)
steps = make_steps(build_model(hf_dir_for(None), dtype), num_prompt, 8, dtype)
names = ("prefill", "prefill_rec_bf16")
for name in names:
    steps[name]()
    steps[name]()
ms: dict[str, dict[str, tuple[float, int]]] = {}
for name in names:
    runs: dict[str, list[tuple[float, int]]] = {}
    for _ in range(3):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            steps[name]()
        for e in prof.key_averages():
            runs.setdefault(e.key, []).append((e.self_cpu_time_total / 1e3, e.count))
    ms[name] = {k: (statistics.median(t for t, _ in v), v[0][1]) for k, v in runs.items()}
plain, rec = ms["prefill"], ms["prefill_rec_bf16"]
print(f"self CPU ms: plain {sum(t for t, _ in plain.values()):.1f}, recording {sum(t for t, _ in rec.values()):.1f}")
for key in sorted(set(plain) | set(rec), key=lambda k: -(rec.get(k, (0, 0))[0] - plain.get(k, (0, 0))[0]))[:10]:
    (a, na), (b, nb) = plain.get(key, (0.0, 0)), rec.get(key, (0.0, 0))
    print(f"{key[:40]:40} plain {a:7.1f} ms ({na:5})  recording {b:7.1f} ms ({nb:5})  {b - a:+7.1f}")
