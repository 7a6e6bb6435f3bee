"""Profile (not a benchmark): a step with a prompt chunk beside decodes, compiled layers vs eager, interleaved.

    python docs/profiles/mixed_step.py 32 256 64 [rounds]   # batch (decodes + 1), their context, prompt tokens

Two engines over one model (one with ``compile_decode=False``), no latency objective (the prompt is not capped),
each filled with the same B - 1 random prompts and stepped until all decode; then ``rounds`` (default 15) rounds in
which each engine gets the same new P-token prompt and runs the step that prefills it beside the B - 1 decodes
(timed), then the next (its one token). Prints the median of each.
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
B, CONTEXT, P = (int(a) for a in sys.argv[1:4])
ROUNDS = int(sys.argv[4]) if len(sys.argv) > 4 else 15
loaded = load_model(None, dtype="auto", device="cpu")
engines = {}
for name, setting in (("eager", False), ("compiled", None)):
    config = EngineConfig(device="cpu", max_num_seqs=B, max_model_len=CONTEXT + P + 64, compile_decode=setting,
                          max_num_batched_tokens=max(512, P + B), slo_tpot_s=0)  # fmt: skip
    engines[name] = LLMEngine(loaded.model, loaded.tokenizer, config)
assert engines["compiled"].runner.compiled is not None, "the compiled layers do not apply here (see compile_decode)"
g = torch.Generator().manual_seed(0)
vocab = loaded.model.config.vocab_size
prompts = [torch.randint(0, vocab, (CONTEXT,), generator=g).tolist() for _ in range(B - 1)]
for engine in engines.values():
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0, ignore_eos=True))
    while engine.waiting_since() is not None:  # until every prompt has its first token
        engine.step()
    for _ in range(3):
        engine.step()
times: dict[str, list[float]] = {name: [] for name in engines}
for r in range(ROUNDS):
    prompt = torch.randint(0, vocab, (P,), generator=g).tolist()
    for name, engine in engines.items():
        engine.add_request(f"new{r}", prompt, SamplingParams(max_tokens=1, temperature=0))
        t0 = time.perf_counter()
        engine.step()
        times[name].append(time.perf_counter() - t0)
        assert engine.last_step[:2] == (B - 1, P), engine.last_step  # the decodes and the whole prompt
        engine.step()
med = {name: sorted(ts)[len(ts) // 2] * 1e3 for name, ts in times.items()}
print(
    f"{B - 1} decodes over {CONTEXT} tokens + a {P}-token prompt, {loaded.model.dtype}, {torch.get_num_threads()} "
    f"threads: step median eager {med['eager']:.1f} ms, compiled {med['compiled']:.1f} ms "
    f"({med['eager'] / med['compiled']:.2f}x)"
)
