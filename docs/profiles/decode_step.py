"""Profile (not a benchmark): the wall time of the engine's decode step, every request decoding, as the server runs it.

    python docs/profiles/decode_step.py 32 256           # batch, prompt tokens; the CLI's memory setting

Fills the batch with random prompts, steps until all decode, then reports the median of 20 ``LLMEngine.step`` calls
and of the ``ModelRunner.run`` inside them (the rest: sampling and postprocessing). bf16 where the CPU runs it fast.
"""

import sys
import time

import torch

from alchemist.config import EngineConfig
from alchemist.engine.engine import LLMEngine
from alchemist.engine.sequence import SamplingParams
from alchemist.host_memory import keep_freed_memory

keep_freed_memory()
B, CONTEXT = int(sys.argv[1]), int(sys.argv[2])
engine = LLMEngine.from_config(EngineConfig(device="cpu", max_num_seqs=B, max_model_len=CONTEXT + 200))
g = torch.Generator().manual_seed(0)
params = SamplingParams(temperature=0, ignore_eos=True)
for i in range(B):
    engine.add_request(
        f"r{i}", torch.randint(0, engine.model.config.vocab_size, (CONTEXT,), generator=g).tolist(), params
    )
while engine.waiting_since() is not None:  # until every prompt has its first token
    engine.step()
for _ in range(3):
    engine.step()
run_s: list[float] = []
inner = engine.runner.run


def timed_run(batch):
    t0 = time.perf_counter()
    result = inner(batch)
    run_s.append(time.perf_counter() - t0)
    return result


engine.runner.run = timed_run
step_s = []
for _ in range(20):
    t0 = time.perf_counter()
    engine.step()
    step_s.append(time.perf_counter() - t0)
step_s.sort()
run_s.sort()
print(f"batch {B}, context {CONTEXT}: step median {step_s[10] * 1e3:.1f} ms, ModelRunner.run {run_s[10] * 1e3:.1f} ms")
