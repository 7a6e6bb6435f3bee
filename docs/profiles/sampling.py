"""Profile (not a benchmark): what a sampled token costs beside a greedy one.

    OMP_NUM_THREADS=1 python docs/profiles/sampling.py [batch] [tokens]     # default 32 rows, 64 tokens

The sampler's draw alone, for ``batch`` rows of the default model's vocabulary (49,152): the inverse CDF
(``alchemist.engine.sampler``, one uniform number per row) against the exponential race it replaced (a number per
vocabulary entry, per row). Then the default engine decoding ``batch`` requests of ``tokens`` tokens each (the same
prompt, EOS ignored), greedy and sampled (temperature 1), twice each.
"""

import sys
import time

import torch

from alchemist.config import EngineConfig
from alchemist.engine import LLMEngine, SamplingParams
from alchemist.engine.sampler import Sampler
from alchemist.model.loader import load_model

BATCH = int(sys.argv[1]) if len(sys.argv) > 1 else 32
TOKENS = int(sys.argv[2]) if len(sys.argv) > 2 else 64


def race(logits: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    probs = torch.softmax(logits, dim=-1)
    return torch.stack([(probs[i] / torch.empty_like(probs[i]).exponential_(generator=g)).argmax()
                        for i, g in enumerate(generators)])  # fmt: skip


def per_draw_ms(draw, repeats: int = 20) -> float:
    draw()
    start = time.perf_counter()
    for _ in range(repeats):
        draw()
    return (time.perf_counter() - start) / repeats * 1e3


logits = torch.randn(BATCH, 49152)
generators = [torch.Generator().manual_seed(i) for i in range(BATCH)]
params = [SamplingParams(temperature=1.0, seed=i) for i in range(BATCH)]
sampler = Sampler()
print(f"draw of {BATCH} rows: inverse CDF {per_draw_ms(lambda: sampler._sample(logits, params, generators)):.1f} ms, "
      f"exponential race {per_draw_ms(lambda: race(logits, generators)):.1f} ms")

loaded = load_model(None, dtype="auto", device="cpu")
engine = LLMEngine(loaded.model, loaded.tokenizer, EngineConfig())
prompt = loaded.tokenizer.user_prompt("Tell me a long story about a ship and its crew.")
for run, temperature in enumerate((0.0, 1.0, 0.0, 1.0)):
    for i in range(BATCH):
        params = SamplingParams(max_tokens=TOKENS, temperature=temperature, seed=i, ignore_eos=True)
        engine.add_request(f"run{run}-{i}", prompt, params)
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    seconds = time.perf_counter() - start
    kind = "greedy " if temperature == 0 else "sampled"
    print(f"{kind} {BATCH} x {TOKENS} tokens: {seconds:.2f} s, {BATCH * TOKENS / seconds:.0f} tokens/s")
