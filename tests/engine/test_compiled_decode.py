"""The compiled decode step (alchemist.engine.compiled_decode) against the eager forward it replaces.

fp32 on the real model is the reference: the eight chat prompts of test_engine_real.py, prefilled in chunks next to
each other's decodes, produce the same greedy tokens through the compiled layers (decode steps and steps with prompt
chunks) as through the eager model. bf16 on
the tiny model agrees to bf16 rounding, with an adapter merged, and a swap serves the new adapter without a
recompile.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from alchemist.config import EngineConfig
from alchemist.engine import LLMEngine, SamplingParams
from alchemist.engine.compiled_decode import compiled_decode_applies, compiled_decode_supported
from alchemist.model.attention import KVCache
from alchemist.model.loader import build_model
from tests.engine.helpers import (
    DEFAULT_EOS_ID,
    char_tokenizer,
    greedy_reference,
    random_adapter,
    random_prompts,
    run_to_end,
)
from tests.engine.test_engine_real import CONFIG, PARAMS

pytestmark = pytest.mark.slow  # scheduled first (tests/conftest.py)

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def test_compiled_fp32_greedy_tokens_equal_eager(smollm2, chat_prompts):
    prompts = chat_prompts
    eager = LLMEngine(smollm2.model, smollm2.tokenizer, EngineConfig(**CONFIG, compile_decode=False))
    compiled = LLMEngine(smollm2.model, smollm2.tokenizer, EngineConfig(**CONFIG, compile_decode=True))
    assert eager.runner.compiled is None and compiled.runner.compiled is not None
    assert sum(len(p) > CONFIG["max_num_batched_tokens"] for p in prompts) >= 4  # chunked, beside decodes
    want = [o.output_token_ids for o in eager.generate(prompts, PARAMS)]
    before = counters["stats"]["unique_graphs"]
    got = [o.output_token_ids for o in compiled.generate(prompts, PARAMS)]
    assert got == want
    # every request decoded through it, at batch sizes 1-8, and prefilled through it, its chunks beside decodes, with
    # no compile beyond the warm-up's
    assert compiled.runner.compiled.num_steps >= PARAMS.max_tokens - 1  # the longest request's decodes at least
    longest = max(-(-len(p) // CONFIG["max_num_batched_tokens"]) for p in prompts)  # its chunks, a step each
    assert compiled.runner.compiled.num_prompt_steps >= longest
    assert counters["stats"]["unique_graphs"] == before


def test_a_swapped_adapter_serves_compiled_without_a_recompile(make_engine, tiny_model):
    engine = make_engine(compile_decode=True)
    warm = counters["stats"]["unique_graphs"]  # after the warm-up
    prompt = random_prompts([9], seed=2)[0]
    for version, seed in ((1, 11), (2, 12)):
        adapter = random_adapter(tiny_model, seed)
        engine.set_adapter(adapter, version)
        engine.add_request("merge", prompt, SamplingParams(max_tokens=tiny_model.config.num_layers + 1))
        run_to_end(engine)  # the merge completes, a layer per step
        steps = engine.runner.compiled.num_steps
        engine.add_request("r", prompt, GREEDY)
        got = run_to_end(engine)["r"][-1].output_token_ids
        assert got == greedy_reference(tiny_model, prompt, GREEDY.max_tokens, [adapter])
        assert engine.runner.compiled.num_steps - steps == GREEDY.max_tokens - 1  # all its decodes compiled
    assert counters["stats"]["unique_graphs"] == warm  # base weights, then merged ones: the same graphs


def test_an_engine_with_other_limits_decodes_through_the_same_graphs(make_engine, tiny_model):
    """The cache's slots and length are dynamic sizes: another --max-num-seqs and --max-model-len compile nothing."""
    prompt = random_prompts([9], seed=3)[0]
    want = greedy_reference(tiny_model, prompt, GREEDY.max_tokens, [None])
    first = make_engine(compile_decode=True, max_num_seqs=4, max_model_len=64)
    warm = counters["stats"]["unique_graphs"]
    for fields in ({"max_num_seqs": 4, "max_model_len": 64}, {"max_num_seqs": 6, "max_model_len": 96}):
        engine = first if fields["max_num_seqs"] == 4 else make_engine(compile_decode=True, **fields)
        cache = engine.runner.cache
        assert (cache.num_slots, cache.max_len) == (fields["max_num_seqs"], fields["max_model_len"])
        engine.add_request("r", prompt, GREEDY)
        assert run_to_end(engine)["r"][-1].output_token_ids == want
        assert engine.runner.compiled.num_steps == GREEDY.max_tokens - 1
    assert counters["stats"]["unique_graphs"] == warm


def test_compiled_bf16_agrees_with_eager_to_rounding(tiny_dirs):
    model = build_model(tiny_dirs["llama-gqa-untied"], torch.bfloat16)
    prompts = random_prompts([5, 17, 30, 9], seed=4)
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, logprobs=0)
    runs = []
    for compile_decode in (False, True):
        config = EngineConfig(max_num_seqs=4, compile_decode=compile_decode)
        engine = LLMEngine(model, char_tokenizer(DEFAULT_EOS_ID), config)
        engine.set_adapter(random_adapter(model, 11), 1)
        engine.add_request("merge", prompts[0], SamplingParams(max_tokens=model.config.num_layers + 1))
        run_to_end(engine)
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, params)
        runs.append(run_to_end(engine))
    assert engine.runner.compiled.num_steps >= 1
    for i in range(len(prompts)):
        eager, compiled = ([lp for out in run[str(i)] for lp in out.logprobs] for run in runs)
        assert [lp.token_id for lp in compiled] == [lp.token_id for lp in eager]
        # the decode step's token: bf16 roundings apart (eager rounds some intermediates inductor keeps in fp32)
        assert compiled[1].logprob == pytest.approx(eager[1].logprob, abs=0.05)


def test_applies_by_default_to_a_bf16_cache(make_engine):
    fp32 = make_engine().runner.cache
    assert compiled_decode_supported(fp32)
    assert not compiled_decode_applies(fp32, None)  # fp32 serves eager unless asked
    assert compiled_decode_applies(fp32, True) and not compiled_decode_applies(fp32, False)
    bf16 = KVCache(2, 4, 32, 1, 16, torch.bfloat16)  # with or without AMX
    assert compiled_decode_applies(bf16, None) and not compiled_decode_applies(bf16, False)
