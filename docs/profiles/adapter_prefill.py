"""Profile (not a benchmark): what serving a LoRA adapter costs a recording prefill step (the delta's path).

    python docs/profiles/adapter_prefill.py [prompt tokens] [rounds]      # defaults: 448 8

SmolLM2 in the dtype the server picks (bf16 here, packed linears), r = 16 on all seven projections, a random
adapter, 8 requests decoding. Each round runs, in each mode, one engine step that prefills a new recorded prompt
of ``prompt tokens`` next to the 8 decodes (a step of ``bench online``'s load): the base model (no adapter), and the
adapter served (a recording forward adds it as a separate delta, ``alchemist.engine.served_adapter``; the decodes
of other steps use the merged weights), and the same with the delta in fp32 at any number of rows (as it was
served before: the bf16 delta of many rows). Prints the median step of each mode and the adapter's cost; then
the delta alone, layer 0's four fused projections at 16-512 rows, in fp32 and in the model's dtype (from
32 rows the served adapter uses the latter: ``FP32_MAX_ROWS``).
"""

import copy
import statistics
import sys
import time

import torch

from alchemist.bench.report import interleaved_medians
from alchemist.config import EngineConfig, RecordConfig
from alchemist.engine import LLMEngine, SamplingParams
from alchemist.host_memory import keep_freed_memory
from alchemist.model.loader import build_model, hf_dir_for, resolve_dtype
from alchemist.model.lora import LoraAdapter
from alchemist.model.tokenizer import Tokenizer

prompt_tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 448
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 8
keep_freed_memory()  # as the server runs
hf_dir = hf_dir_for(None)
model = build_model(hf_dir, resolve_dtype("auto", torch.device("cpu")))
config = EngineConfig(max_num_seqs=16, max_model_len=1024)
engine = LLMEngine(model, Tokenizer.from_pretrained(hf_dir), config, RecordConfig())
adapter = LoraAdapter(model.config, seed=0)
with torch.no_grad():
    for b in adapter.B.values():
        b.normal_(std=0.01)
engine.set_adapter(adapter, 1)
g = torch.Generator().manual_seed(0)
for i in range(8):
    prompt = torch.randint(0, model.config.vocab_size, (200,), generator=g).tolist()
    engine.add_request(f"d{i}", prompt, SamplingParams(max_tokens=800, ignore_eos=True))
while engine.stats().num_waiting or not engine.runner.merged.complete:  # prefills done, merge complete
    engine.step()
runner = engine.runner
fp32_delta = copy.copy(runner.adapter)
fp32_delta._low = {}  # the delta in fp32 whatever the rows (as served before the bf16 delta of many rows)
modes = {"base": (None, None), "adapter": (runner.adapter, runner.merged), "fp32 delta": (fp32_delta, runner.merged)}
times: dict[str, list[float]] = {mode: [] for mode in modes}
for r in range(rounds):
    for mode, (served, merged) in modes.items():
        runner.adapter, runner.merged = served, merged
        prompt = torch.randint(0, model.config.vocab_size, (prompt_tokens,), generator=g).tolist()
        engine.add_request(f"p{r}-{mode}", prompt, SamplingParams(max_tokens=1, ignore_eos=True, record=True))
        t0 = time.perf_counter()
        engine.step()
        times[mode].append(time.perf_counter() - t0)
med = {mode: 1e3 * statistics.median(v) for mode, v in times.items()}
print(f"{model.dtype}, a recorded prefill of {prompt_tokens} tokens next to 8 decodes, median of {rounds} steps per "
      f"mode (ms): {({mode: round(v, 1) for mode, v in med.items()})}; the adapter costs "
      f"{100 * (med['adapter'] / med['base'] - 1):+.1f}% (its delta in fp32: "
      f"{100 * (med['fp32 delta'] / med['base'] - 1):+.1f}%)")  # fmt: skip

# The delta alone (what ``FP32_MAX_ROWS`` chooses by): layer 0's four fused deltas as ``ServedAdapter.delta``
# computes them, with its fp32 weights and with its model-dtype ones, at a few row counts, interleaved.
served = modes["adapter"][0]


def deltas(weights: dict, xs: dict) -> None:
    for name, x in xs.items():
        at, bt = weights[0, name]
        torch.mm(torch.mm(x.to(at.dtype), at), bt).to(x.dtype)


for rows in (16, 32, 64, 128, 512):
    xs = {name: torch.randn(rows, at.shape[0], generator=g).to(model.dtype)
          for (layer, name), (at, _) in served._weights.items() if layer == 0}  # fmt: skip
    us = interleaved_medians({"fp32": lambda xs=xs: deltas(served._weights, xs),
                              str(model.dtype): lambda xs=xs: deltas(served._low, xs)}, 200)  # fmt: skip
    print(f"the four fused deltas at {rows} rows: " + ", ".join(f"{k} {1e6 * v:.0f} us" for k, v in us.items()))
