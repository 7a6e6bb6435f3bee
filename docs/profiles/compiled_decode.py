"""Profile (not a benchmark): the engine's decode step, compiled layer vs eager, interleaved step by step.

    python docs/profiles/compiled_decode.py 32 256 [rounds]   # batch, prompt tokens; bf16 where the CPU runs it fast

Two engines over one model (one with ``compile_decode=False``), each filled with the same random prompts and stepped
until all decode; then ``rounds`` (default 30) rounds of one step of each, alternating, and the median of each. Also
prints the warm-up (compile) time of the compiled engine's construction.
"""

import sys
import time

import torch

from alchemist.config import EngineConfig
from alchemist.engine.engine import LLMEngine
from alchemist.engine.sequence import SamplingParams
from alchemist.host_memory import keep_freed_memory
from alchemist.model.loader import load_model

keep_freed_memory()
B, CONTEXT = int(sys.argv[1]), int(sys.argv[2])
ROUNDS = int(sys.argv[3]) if len(sys.argv) > 3 else 30
loaded = load_model(None, dtype="auto", device="cpu")
engines = {}
for name, setting in (("eager", False), ("compiled", None)):
    t0 = time.perf_counter()
    config = EngineConfig(device="cpu", max_num_seqs=B, max_model_len=CONTEXT + ROUNDS + 64, compile_decode=setting)
    engines[name] = LLMEngine(loaded.model, loaded.tokenizer, config)
    print(f"{name}: engine built in {time.perf_counter() - t0:.1f} s", flush=True)
assert engines["compiled"].runner.compiled is not None, "the compiled layer does not apply here (see compile_decode)"
g = torch.Generator().manual_seed(0)
prompts = [torch.randint(0, loaded.model.config.vocab_size, (CONTEXT,), generator=g).tolist() for _ in range(B)]
params = SamplingParams(temperature=0, ignore_eos=True)
for engine in engines.values():
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    while engine.waiting_since() is not None:  # until every prompt has its first token
        engine.step()
    for _ in range(3):
        engine.step()
times: dict[str, list[float]] = {name: [] for name in engines}
for _ in range(ROUNDS):
    for name, engine in engines.items():
        t0 = time.perf_counter()
        engine.step()
        times[name].append(time.perf_counter() - t0)
med = {name: sorted(ts)[len(ts) // 2] * 1e3 for name, ts in times.items()}
print(
    f"batch {B}, context {CONTEXT}, {loaded.model.dtype}, {torch.get_num_threads()} threads: step median eager "
    f"{med['eager']:.1f} ms, compiled {med['compiled']:.1f} ms ({med['eager'] / med['compiled']:.2f}x)"
)
