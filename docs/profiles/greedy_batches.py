"""Profile (not a benchmark): does a greedy answer depend on the batches it is decoded in?

    python docs/profiles/greedy_batches.py [questions] [tokens] [--emulate-precision-casts]
                                                       # default 30 ShareGPT first turns, 32 tokens

The same ``questions`` greedy answers (``tokens`` long, prefix caching off) from one engine, asked four ways: one
at a time, one at a time again, all added together, and in two waves (the first third, then the rest while the
first decodes: steps that mix prefills with decodes). For the default engine (bf16 where the CPU runs it fast, the
compiled decode step) and the eager one (``compile_decode=False``): how many answers equal the one-at-a-time ones,
and how many of each engine's one-at-a-time answers equal fp32's (eager, the exactness reference).
``--emulate-precision-casts``: inductor rounds its low-precision intermediates as eager does (its config option).
"""

import itertools
import sys

import torch._inductor.config

from alchemist.bench.sharegpt import sample_requests
from alchemist.config import EngineConfig
from alchemist.engine.engine import LLMEngine
from alchemist.engine.sequence import SamplingParams
from alchemist.model.loader import load_model

args = [a for a in sys.argv[1:] if a != "--emulate-precision-casts"]
N = int(args[0]) if args else 30
TOKENS = int(args[1]) if len(args) > 1 else 32
torch._inductor.config.emulate_precision_casts = "--emulate-precision-casts" in sys.argv
ids = itertools.count()


def answers(engine: LLMEngine, waves: list[list[list[int]]]) -> list[list[int]]:
    """Each wave added when the one before is in flight (its prompts prefilled); every answer, in prompt order."""
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0)
    done, order = {}, []
    for wave in waves:
        for prompt in wave:
            rid = f"r{next(ids)}"
            order.append(rid)
            engine.add_request(rid, prompt, params)
        done.update((o.request_id, o.output_token_ids) for o in engine.step() if o.finished)
    while len(done) < len(order):
        done.update((o.request_id, o.output_token_ids) for o in engine.step() if o.finished)
    return [list(done[rid]) for rid in order]


def alone(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    return [answers(engine, [[p]])[0] for p in prompts]


def same(a: list[list[int]], b: list[list[int]]) -> int:
    return sum(x == y for x, y in zip(a, b, strict=True))


bf16 = load_model(None, dtype="auto", device="cpu")
tok = bf16.tokenizer
pool = sample_requests(N, seed=29, mode="first_turn", tokenizer=tok, max_prompt_tokens=96)
prompts = [tok.user_prompt(s.messages[0]["content"]) for s in pool][:N]
fp32 = load_model(None, dtype="float32", device="cpu")
reference = alone(LLMEngine(fp32.model, tok, EngineConfig(compile_decode=False, enable_prefix_caching=False)), prompts)
print(f"{bf16.model.dtype}, {N} questions, {TOKENS} tokens; answers equal to the same engine's one-at-a-time ones")
print("| engine | one at a time again | all together | two waves | one at a time == fp32 |")
print("|---|---|---|---|---|")
for name, setting in (("default (compiled decode)", None), ("eager", False)):
    engine = LLMEngine(bf16.model, tok, EngineConfig(compile_decode=setting, enable_prefix_caching=False))
    first = alone(engine, prompts)
    again = alone(engine, prompts)
    together = answers(engine, [prompts])
    cut = len(prompts) // 3
    waves = answers(engine, [prompts[:cut], prompts[cut:]])
    print(f"| {name} | {same(first, again)} | {same(first, together)} | {same(first, waves)} | "
          f"{same(first, reference)} |", flush=True)  # fmt: skip
