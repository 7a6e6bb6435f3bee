"""Profile (not a benchmark): what serving a LoRA adapter costs a decode step, as a separate delta vs merged.

    python docs/profiles/adapter_decode.py [batch] [steps]      # defaults: 8 60

SmolLM2 in the dtype the server picks (bf16 here, packed linears), r = 16 on all seven projections, a random
adapter; ``batch`` requests with 256-token prompts decoding. Each round runs one decode step in each mode,
interleaved: the base model (no adapter), the adapter as a separate low-rank delta (what a recording forward uses),
and the adapter merged into the weights (``alchemist.engine.merged_adapter``, what every other forward uses).
Prints the median step time of each mode and the adapter's cost over the base model; then what merging costs
(``MergedLinearOps.merge_next``, one layer per engine step after a swap: median and total over the layers) and
the merged weights' size.
"""

import statistics
import sys
import time

import torch

from alchemist.config import EngineConfig
from alchemist.engine import LLMEngine, SamplingParams
from alchemist.engine.merged_adapter import MergedLinearOps
from alchemist.model.loader import build_model, hf_dir_for, resolve_dtype
from alchemist.model.lora import LoraAdapter
from alchemist.model.tokenizer import Tokenizer

batch = int(sys.argv[1]) if len(sys.argv) > 1 else 8
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 60
hf_dir = hf_dir_for(None)
model = build_model(hf_dir, resolve_dtype("auto", torch.device("cpu")))
engine = LLMEngine(model, Tokenizer.from_pretrained(hf_dir), EngineConfig(max_num_seqs=batch, max_model_len=1024))
adapter = LoraAdapter(model.config, seed=0)
with torch.no_grad():
    for b in adapter.B.values():
        b.normal_(std=0.01)
engine.set_adapter(adapter, 1)
g = torch.Generator().manual_seed(0)
for i in range(batch):
    prompt = torch.randint(0, model.config.vocab_size, (256,), generator=g).tolist()
    engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=3 * rounds + 50, ignore_eos=True))
while engine.stats().num_waiting or not engine.runner.merged.complete:  # prefills done, merge complete
    engine.step()
runner = engine.runner
served, merged = runner.adapter, runner.merged
modes = {"base": (None, None), "delta": (served, None), "merged": (served, merged)}
times: dict[str, list[float]] = {mode: [] for mode in modes}
for _ in range(rounds):
    for mode, (a, m) in modes.items():
        runner.adapter, runner.merged = a, m
        t0 = time.perf_counter()
        engine.step()
        times[mode].append(time.perf_counter() - t0)
med = {mode: 1e3 * statistics.median(v) for mode, v in times.items()}
cost = {mode: f"{100 * (med[mode] / med['base'] - 1):+.1f}%" for mode in ("delta", "merged")}
print(f"{model.dtype}, batch {batch}, median of {rounds} decode steps per mode (ms):",
      {mode: round(v, 2) for mode, v in med.items()}, "cost over base:", cost)  # fmt: skip

fresh = MergedLinearOps(model, served, runner.ops, merged.packed)  # the runner's own kind of merge, again
layer_ms = []
while not fresh.complete:
    t0 = time.perf_counter()
    fresh.merge_next()
    layer_ms.append(1e3 * (time.perf_counter() - t0))
merged_mb = sum(served.merged_weight(0, name, getattr(model.layers[0], f"{name}_weight")).nbytes
                for name in ("qkv", "o", "gate_up", "down")) * model.config.num_layers / 1e6  # fmt: skip
print(f"merge: {statistics.median(layer_ms):.1f} ms per layer (median), {sum(layer_ms):.0f} ms for all "
      f"{len(layer_ms)}; merged weights {merged_mb:.0f} MB")  # fmt: skip
