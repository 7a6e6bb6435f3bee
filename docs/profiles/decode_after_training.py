"""Profile (not a benchmark): what a training slice does to the decode step that follows it.

    python docs/profiles/decode_after_training.py [batch] [rounds]      # defaults: 4 40

``bench online`` measures TPOT with training time-sliced between engine steps at a 0.25 share, which alone would
stretch a token by 1/(1 - 0.25) = 1.33x; it measures more. This asks whether the decode steps themselves get
slower after training ran. SmolLM2 in the server's dtype (bf16, packed linears, the adapter merged), ``batch``
requests with 256-token prompts decoding; one replayed training sample (a recorded 256-token prompt, a 64-token
response) cut in its slices as the online trainer runs them. Each round times one decode step in each setting,
interleaved: right after another decode step (``alone``), right after one training slice (``after_slice``), and
right after sleeping as long as that slice took (``after_idle``: the gap without the work). Prints the medians and
the slices' median length.
"""

import statistics
import sys
import time

import torch

from alchemist.config import EngineConfig, RecordConfig
from alchemist.engine import LLMEngine, SamplingParams
from alchemist.model.loader import build_model, hf_dir_for, resolve_dtype
from alchemist.model.lora import LoraAdapter
from alchemist.model.tokenizer import Tokenizer
from alchemist.training.trainer import Sample, Trainer, TrainerConfig

batch = int(sys.argv[1]) if len(sys.argv) > 1 else 4
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 40
hf_dir = hf_dir_for(None)
model = build_model(hf_dir, resolve_dtype("auto", torch.device("cpu")))
engine = LLMEngine(
    model,
    Tokenizer.from_pretrained(hf_dir),
    EngineConfig(max_num_seqs=batch + 1, max_model_len=1024),
    RecordConfig(policy="requested", dtype="bfloat16"),
)
adapter = LoraAdapter(model.config, seed=0)
with torch.no_grad():
    for b in adapter.B.values():
        b.normal_(std=0.01)
engine.set_adapter(adapter, 1)
g = torch.Generator().manual_seed(0)
recorded = torch.randint(0, model.config.vocab_size, (256,), generator=g).tolist()
engine.add_request("t", recorded, SamplingParams(max_tokens=1, record=True))
for i in range(batch):
    prompt = torch.randint(0, model.config.vocab_size, (256,), generator=g).tolist()
    engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=4 * rounds + 50, ignore_eos=True))
while engine.stats().num_waiting or "t" not in engine.store or not engine.runner.merged.complete:
    engine.step()

trainer = Trainer(model, adapter, engine.store, TrainerConfig(max_staleness=10**9))
sample = Sample(recorded, torch.randint(0, model.config.vocab_size, (64,), generator=g).tolist(), "t")
slices = trainer.backward_slices([sample], [1.0])


def training_slice() -> float:
    global slices
    t0 = time.perf_counter()
    try:
        next(slices)
    except StopIteration:
        trainer.optimizer.zero_grad(set_to_none=True)
        slices = trainer.backward_slices([sample], [1.0])
        next(slices)
    return time.perf_counter() - t0


def timed_step() -> float:
    t0 = time.perf_counter()
    engine.step()
    return time.perf_counter() - t0


times: dict[str, list[float]] = {"alone": [], "after_slice": [], "after_idle": []}
slice_s: list[float] = []
for _ in range(rounds):
    engine.step()
    times["alone"].append(timed_step())
    took = training_slice()
    slice_s.append(took)
    times["after_slice"].append(timed_step())
    time.sleep(took)
    times["after_idle"].append(timed_step())
med = {mode: 1e3 * statistics.median(v) for mode, v in times.items()}
print(
    f"{model.dtype}, batch {batch}, {rounds} rounds; median decode step (ms):",
    {mode: round(v, 2) for mode, v in med.items()},
    "over alone:",
    {mode: f"{100 * (med[mode] / med['alone'] - 1):+.1f}%" for mode in ("after_slice", "after_idle")},
    f"median slice {1e3 * statistics.median(slice_s):.1f} ms",
)
