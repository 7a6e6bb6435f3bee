"""Profile (not a benchmark): the replay walk with its flash-attention backward run in fp32 on upcast inputs.

    python docs/profiles/attention_upcast.py 250 64 4 5      # P, R, group size G, repeats

SmolLM2 in bf16 with bf16 records, G random samples replayed together (gradients only), 2 threads, interleaved
medians per sample: the walk's non-top layers calling the bf16 flash backward as shipped, against the same kernel
on fp32 copies of its inputs (results cast back). fp32 is faster than bf16 on short sequences and slower on long
ones (``docs/profiles/attention_backward.py``); recompute's autograd would need the same choice for a fair baseline.
"""

import statistics
import sys
import time

import torch

import alchemist.training.layer_backward as layer_backward
from alchemist.bench.training import record_prefill
from alchemist.model.loader import build_model, hf_dir_for
from alchemist.model.lora import LoraAdapter
from alchemist.training.replay import ReplaySample, replay_backward_slices
from alchemist.training.slices import run_to_end

torch.set_num_threads(2)
P, R, G, repeats = (int(a) for a in sys.argv[1:5])
model = build_model(hf_dir_for(None), torch.bfloat16)
adapter = LoraAdapter(model.config, seed=0)
g = torch.Generator().manual_seed(0)
vocab = model.config.vocab_size
samples = [(torch.randint(0, vocab, (P,), generator=g), torch.randint(0, vocab, (R,), generator=g)) for _ in range(G)]
records = [record_prefill(model, adapter, prompt, torch.bfloat16) for prompt, _ in samples]
bf16_kernel = layer_backward.flash_backward


def fp32_kernel(d_out, q, k, v, out, lse, *args, **kwargs):
    grads = bf16_kernel(d_out.float(), q.float(), k.float(), v.float(), out.float(), lse, *args, **kwargs)
    return tuple(t.to(q.dtype) for t in grads)


def replay_group():
    pairs = zip(samples, records, strict=True)
    group = [ReplaySample(p, r, rec.layers.__getitem__, loss_scale=1.0 / G) for (p, r), rec in pairs]
    run_to_end(replay_backward_slices(model, adapter, group))


kernels = {"bf16": bf16_kernel, "fp32 upcast": fp32_kernel}
times: dict[str, list[float]] = {name: [] for name in kernels}
for i in range(repeats + 1):  # the first round warms up
    for name, kernel in kernels.items():
        layer_backward.flash_backward = kernel
        t0 = time.perf_counter()
        replay_group()
        if i:
            times[name].append(time.perf_counter() - t0)
layer_backward.flash_backward = bf16_kernel
med = {name: statistics.median(v) for name, v in times.items()}
print(f"P={P} R={R} G={G}: ms per sample", {name: round(1e3 * s / G, 1) for name, s in med.items()},
      f"fp32 upcast / bf16 {med['fp32 upcast'] / med['bf16']:.3f}")  # fmt: skip
