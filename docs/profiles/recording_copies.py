"""Profile (not a benchmark): what a recording prefill pays for, taken apart, in one process, interleaved.

    python docs/profiles/recording_copies.py 1024 15 bfloat16      # prompt tokens, repeats, model dtype

SmolLM2 with LoRA on (B = 0), 2 threads, the CLI's memory setting (``host_memory.py``); records in bf16;
medians, and each mode's time over ``plain``'s:

- ``plain``: a serving prefill that records nothing (inference mode, no log-sum-exp);
- ``plain_no_grad``: the same under ``no_grad`` instead of inference mode (what running recording forwards outside
  inference mode, to get normal tensors, would cost);
- ``lse``: ``plain`` asking the attention kernel for its log-sum-exp;
- ``keep``: also keeping every tensor a record holds alive until the forward ends, no copy (what recording cannot
  do with less memory traffic);
- ``record``: ``bench train``'s recording prefill, as the engine records (it keeps the forward's outputs when the
  model is bf16; with an fp32 model it casts every row into buffers allocated before the forward);
- ``record_copied``: every row copied into buffers allocated before the forward (``keep_outputs=False``);
- ``record_lazy`` (fp32 model only): ``keep_outputs=True`` where nothing can be kept (a cast), so every copy goes
  into a buffer allocated when its first rows arrive, between the forward's temporaries.
"""

import statistics
import sys
import time

import torch

from alchemist.bench.training import record_prefill
from alchemist.host_memory import keep_freed_memory
from alchemist.model.attention import AttentionMetadata, attend
from alchemist.model.loader import build_model, hf_dir_for
from alchemist.model.lora import LoraAdapter
from alchemist.model.seam import COMPUTE, ComputeOps

n, repeats = int(sys.argv[1]), int(sys.argv[2])
dtype = getattr(torch, sys.argv[3]) if len(sys.argv) > 3 else torch.bfloat16
keep_freed_memory()
torch.set_num_threads(2)
model = build_model(hf_dir_for(None), dtype)
prompt = torch.randint(0, model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(0))
adapter = LoraAdapter(model.config, seed=0)


class LseOps(ComputeOps):
    def attention(self, layer, q, k, v, meta):
        return attend(layer, q, k, v, meta).out


class KeepOps(ComputeOps):
    def __init__(self):
        self.kept = []

    def layer_input(self, layer, h):
        self.kept.append(h)

    def linear(self, layer, name, x, weight, bias):
        y = super().linear(layer, name, x, weight, bias)
        self.kept.append(y)
        return y

    def attention(self, layer, q, k, v, meta):
        result = attend(layer, q, k, v, meta)
        self.kept += [result.out, result.lse]
        return result.out


def forward(ops, need_lse, mode=torch.inference_mode):
    with mode():
        model(prompt, torch.arange(n), AttentionMetadata.single(n, need_lse=need_lse), ops, adapter)


def record(keep_outputs=None):
    return lambda: record_prefill(model, adapter, prompt, torch.bfloat16, keep_outputs=keep_outputs)


modes = {
    "plain": lambda: forward(COMPUTE, False),
    "plain_no_grad": lambda: forward(COMPUTE, False, torch.no_grad),
    "lse": lambda: forward(LseOps(), True),
    "keep": lambda: forward(KeepOps(), True),
    "record": record(),
    "record_copied": record(keep_outputs=False),
}
if dtype != torch.bfloat16:
    modes["record_lazy"] = record(keep_outputs=True)
times = {mode: [] for mode in modes}
for run in modes.values():
    run()
for _ in range(repeats):
    for mode, run in modes.items():
        t0 = time.perf_counter()
        run()
        times[mode].append(time.perf_counter() - t0)
med = {mode: statistics.median(v) for mode, v in times.items()}
print(f"P={n} model {dtype} repeats={repeats}")
for mode, t in med.items():
    print(f"  {mode:14s} {1e3 * t:8.1f} ms  {100 * (t / med['plain'] - 1):+6.2f}%")
