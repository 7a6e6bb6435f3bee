"""On the real default model (SmolLM2-135M-Instruct, fp32): the engine serving a LoRA adapter produces the greedy
tokens of a plain loop over ``Llama.forward(..., adapter=adapter)``, alone and batched with chunked prefills."""

from __future__ import annotations

import pytest

from alchemist.config import EngineConfig
from alchemist.engine import LLMEngine, SamplingParams
from tests.engine.helpers import greedy_reference, random_adapter

TOPICS = ["bread", "black holes", "the piano", "Rome"]
PARAMS = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
CONFIG = dict(max_num_batched_tokens=64, max_model_len=512, max_num_seqs=4)


@pytest.fixture(scope="module")
def prompts(smollm2) -> list[list[int]]:
    tok = smollm2.tokenizer
    padding = "Please be detailed. "
    return [
        tok.apply_chat_template([{"role": "user", "content": f"{padding * (8 * i)}Tell me about {t}."}])
        for i, t in enumerate(TOPICS)
    ]


def test_served_adapter_matches_forward_with_the_adapter(smollm2, prompts):
    model = smollm2.model
    adapter = random_adapter(model, seed=0, std=0.05)  # large enough to change every answer
    reference = [greedy_reference(model, p, PARAMS.max_tokens, [adapter]) for p in prompts]
    engine = LLMEngine(model, smollm2.tokenizer, EngineConfig(**CONFIG))
    base = [o.output_token_ids for o in engine.generate(prompts, PARAMS)]
    assert all(r != b for r, b in zip(reference, base, strict=True))

    engine.set_adapter(adapter, 1)
    alone = [engine.generate([p], PARAMS)[0].output_token_ids for p in prompts]
    assert alone == reference
    assert sum(len(p) > CONFIG["max_num_batched_tokens"] for p in prompts) >= 2  # chunked next to decodes
    batched = engine.generate(prompts, PARAMS)
    assert [o.output_token_ids for o in batched] == reference
    assert {o.adapter_version for o in batched} == {1}
