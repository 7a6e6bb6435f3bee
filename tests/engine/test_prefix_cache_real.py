"""On the real default model (SmolLM2-135M-Instruct, fp32): a prompt served from cached prefix blocks gives the
tokens and logprobs of the same prompt on a cold engine, whether the blocks sit in a free slot (taken as they are)
or in a running sequence's slot (copied); after an adapter swap, nothing cached under the old version is used.

The prompts share a long system message (over a dozen full blocks) and differ in the question.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from alchemist.config import EngineConfig
from alchemist.engine import LLMEngine, RequestOutput, SamplingParams
from tests.engine.helpers import random_adapter

PARAMS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=0)
CONFIG = dict(max_model_len=512, max_num_seqs=4)
QUESTIONS = ["Tell me about bread.", "Tell me about black holes.", "Tell me about Rome.", "What is a piano?"]
SYSTEM = "You are a helpful assistant. " + "Answer carefully, with detail and examples. " * 24


@pytest.fixture(scope="module")
def prompts(smollm2) -> list[list[int]]:
    tok = smollm2.tokenizer
    return [
        tok.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])
        for q in QUESTIONS
    ]


@pytest.fixture(scope="module")
def cold(smollm2, prompts) -> list[Result]:
    """Each prompt alone on a fresh engine: nothing cached."""
    return [serve(LLMEngine(smollm2.model, smollm2.tokenizer, EngineConfig(**CONFIG)), p) for p in prompts]


@dataclass
class Result:
    tokens: list[int]
    logprobs: list[float]  # of each token
    adapter_version: int


def collect(outputs: list[RequestOutput], results: dict[str, Result]) -> None:
    for out in outputs:
        r = results.setdefault(out.request_id, Result([], [], 0))
        r.tokens.extend(out.new_token_ids)
        r.logprobs.extend(lp.logprob for lp in out.logprobs or [])
        r.adapter_version = out.adapter_version


def serve(engine: LLMEngine, prompt: list[int]) -> Result:
    """``prompt`` through ``engine`` to the end, alone."""
    engine.add_request("r", prompt, PARAMS)
    results: dict[str, Result] = {}
    while engine.has_unfinished():
        collect(engine.step(), results)
    return results["r"]


def common_blocks(a: list[int], b: list[int], block_size: int = 16) -> int:
    """Full blocks ``a`` and ``b`` share from the start."""
    n = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    return n // block_size


def assert_same(got: Result, want: Result) -> None:
    assert got.tokens == want.tokens and len(got.logprobs) == len(want.logprobs) == PARAMS.max_tokens
    assert max(abs(a - b) for a, b in zip(got.logprobs, want.logprobs, strict=True)) <= 1e-5


def test_cached_prefix_gives_the_cold_engine_outputs(smollm2, prompts, cold):
    num_blocks = common_blocks(prompts[0], prompts[1])
    assert num_blocks >= 12
    engine = LLMEngine(smollm2.model, smollm2.tokenizer, EngineConfig(**CONFIG))
    assert_same(serve(engine, prompts[0]), cold[0])
    assert engine.stats().num_prefix_cache_hits == 0
    # The first finished: its slot is free and holds the shared blocks, and the second takes it as it is.
    assert_same(serve(engine, prompts[1]), cold[1])
    stats = engine.stats()
    assert stats.num_prefix_cache_hits == num_blocks * 16
    assert stats.num_prefix_cache_queries == len(prompts[0]) + len(prompts[1])


def test_prefix_held_by_a_running_sequence_is_copied(smollm2, prompts, cold):
    engine = LLMEngine(smollm2.model, smollm2.tokenizer, EngineConfig(**CONFIG))
    engine.add_request("first", prompts[2], PARAMS)
    results: dict[str, Result] = {}
    collect(engine.step(), results)  # first's whole prompt, now cached; it decodes on
    engine.add_request("second", prompts[3], PARAMS)
    batch_copies = []
    schedule = engine.scheduler.schedule

    def spy(*args, **kwargs):
        batch = schedule(*args, **kwargs)
        batch_copies.extend(batch.prefix_copies)
        return batch

    engine.scheduler.schedule = spy
    while engine.has_unfinished():
        collect(engine.step(), results)
    num_tokens = common_blocks(prompts[2], prompts[3]) * 16
    assert len(batch_copies) == 1 and batch_copies[0][2] == num_tokens and batch_copies[0][0] != batch_copies[0][1]
    assert engine.stats().num_prefix_cache_hits == num_tokens
    assert_same(results["first"], cold[2])
    assert_same(results["second"], cold[3])


def test_after_an_adapter_swap_the_old_versions_blocks_serve_nothing(smollm2, prompts, cold):
    model = smollm2.model
    adapter = random_adapter(model, seed=0, std=0.05)
    engine = LLMEngine(model, smollm2.tokenizer, EngineConfig(**CONFIG))
    serve(engine, prompts[0])  # cached under version 0
    engine.set_adapter(adapter, 1)
    before = engine.stats()
    out = serve(engine, prompts[0])
    after = engine.stats()
    assert after.num_prefix_cache_hits == before.num_prefix_cache_hits  # no hit for it
    assert after.num_prefix_cache_queries == before.num_prefix_cache_queries + len(prompts[0])

    cold_engine = LLMEngine(model, smollm2.tokenizer, EngineConfig(**CONFIG, enable_prefix_caching=False))
    cold_engine.set_adapter(adapter, 1)
    reference = serve(cold_engine, prompts[0])
    assert out.tokens == reference.tokens != cold[0].tokens
    assert out.adapter_version == 1
    # Blocks computed under version 1 do serve version 1.
    serve(engine, prompts[1])
    hits = common_blocks(prompts[0], prompts[1]) * 16
    assert engine.stats().num_prefix_cache_hits == after.num_prefix_cache_hits + hits
