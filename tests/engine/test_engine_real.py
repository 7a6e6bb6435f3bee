"""On the real default model (SmolLM2-135M-Instruct, fp32): batching, chunked prefill and preemption are exact.

Eight chat prompts of 38 to 372 tokens run together with a 64-token step budget (so six of them are prefilled
in chunks, next to the others' decodes) and must produce exactly the greedy tokens each produces alone.
"""

from __future__ import annotations

import pytest

from alchemist.config import EngineConfig
from alchemist.engine import LLMEngine, SamplingParams

pytestmark = pytest.mark.slow  # scheduled first (tests/conftest.py)

PARAMS = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
CONFIG = dict(max_num_batched_tokens=64, max_model_len=1024, max_num_seqs=8)


@pytest.fixture(scope="module")
def alone(smollm2, chat_prompts) -> list[list[int]]:
    engine = LLMEngine(smollm2.model, smollm2.tokenizer, EngineConfig(**CONFIG))
    return [engine.generate([p], PARAMS)[0].output_token_ids for p in chat_prompts]


def test_concurrent_greedy_requests_match_alone(smollm2, chat_prompts, alone):
    assert sum(len(p) > CONFIG["max_num_batched_tokens"] for p in chat_prompts) >= 4
    engine = LLMEngine(smollm2.model, smollm2.tokenizer, EngineConfig(**CONFIG))
    outs = engine.generate(chat_prompts, PARAMS)
    assert [o.output_token_ids for o in outs] == alone


def test_preemption_under_a_small_cache_matches_alone(smollm2, chat_prompts, alone):
    # 30 blocks of 16 tokens (480) for ~1,800 tokens of demand; the longest request alone needs 25 blocks.
    engine = LLMEngine(smollm2.model, smollm2.tokenizer, EngineConfig(**CONFIG, num_kv_blocks=30))
    outs = engine.generate(chat_prompts, PARAMS)
    assert engine.stats().num_preemptions > 0
    assert [o.output_token_ids for o in outs] == alone
