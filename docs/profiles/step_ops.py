"""Profile (not a benchmark): where a training step's time goes, by op (torch.profiler, self CPU time).

    python docs/profiles/step_ops.py 256 64 4 bfloat16      # P, R, group size G, model and record dtype

SmolLM2, 2 threads, 2 warm-up passes then 3 profiled: ``bench train``'s recompute and replay steps of one sample
(forward + backward + AdamW), and the gradients of G such samples replayed together (one walk: no optimizer step);
per pass: wall time, the ops' summed self time, and the 10 largest ops with their share and calls.
"""

import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from alchemist.bench.training import make_steps, record_prefill
from alchemist.model.loader import build_model, hf_dir_for
from alchemist.model.lora import LoraAdapter
from alchemist.training.replay import ReplaySample, replay_backward_slices
from alchemist.training.slices import run_to_end

torch.set_num_threads(2)
P, R, G = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
dtype = getattr(torch, sys.argv[4]) if len(sys.argv) > 4 else torch.float32
model = build_model(hf_dir_for(None), dtype)
steps = make_steps(model, P, R, dtype)
adapter = LoraAdapter(model.config, seed=0)
g = torch.Generator().manual_seed(0)
vocab = model.config.vocab_size
samples = [(torch.randint(0, vocab, (P,), generator=g), torch.randint(0, vocab, (R,), generator=g)) for _ in range(G)]
records = [record_prefill(model, adapter, prompt, dtype) for prompt, _ in samples]


def replay_group():
    pairs = zip(samples, records, strict=True)
    group = [ReplaySample(p, r, rec.layers.__getitem__, loss_scale=1.0 / G) for (p, r), rec in pairs]
    run_to_end(replay_backward_slices(model, adapter, group))


passes = {"recompute": steps["recompute"], "replay": steps["replay"], f"replay x{G} together": replay_group}
for name, fn in passes.items():
    for _ in range(2):
        fn()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            fn()
    wall = (time.perf_counter() - t0) / 3
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in events) / 3e6
    print(f"{name}: wall {1e3 * wall:.0f} ms per pass (profiled), ops' self time {1e3 * total:.0f} ms")
    for e in events[:10]:
        ms = e.self_cpu_time_total / 3e3
        print(f"  {e.key:58s} {ms:8.1f} ms {100 * ms / 1e3 / total:5.1f}% {e.count // 3:6d} calls")
