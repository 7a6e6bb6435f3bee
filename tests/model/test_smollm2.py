"""The real default model (SmolLM2-135M-Instruct GGUF) against transformers on a real chat prompt."""

from __future__ import annotations

import pytest
import torch
import transformers

from alchemist.model.attention import AttentionMetadata, KVCache, Segment

MESSAGES = [{"role": "user", "content": "What are the three primary colors, and why are they called primary?"}]


@pytest.fixture(scope="module")
def reference(smollm2):
    return transformers.AutoModelForCausalLM.from_pretrained(smollm2.hf_dir, dtype=torch.float32).eval()


@torch.inference_mode()
def test_logits_match_transformers(smollm2, reference):
    ids = torch.tensor(smollm2.tokenizer.apply_chat_template(MESSAGES))
    model = smollm2.model
    got = model.logits(model(ids, torch.arange(len(ids)), AttentionMetadata.single(len(ids))))
    expected = reference(ids[None]).logits[0]
    assert (got - expected).abs().max().item() <= 1e-4


def greedy_with_cache(model, prompt: torch.Tensor, num_tokens: int) -> list[int]:
    """Prefill, then decode one token at a time from the KV cache (the serving path's attention)."""
    c = model.config
    cache = KVCache(c.num_layers, 1, len(prompt) + num_tokens, c.num_kv_heads, c.head_dim, model.dtype)
    ids, start, out = prompt, 0, []
    for _ in range(num_tokens):
        meta = AttentionMetadata([Segment(slot=0, start=start, length=len(ids))], cache=cache)
        hidden = model(ids, torch.arange(start, start + len(ids)), meta)
        token = int(model.logits(hidden[-1:]).argmax(-1))
        out.append(token)
        start += len(ids)
        ids = torch.tensor([token])
    return out


@torch.inference_mode()
def test_greedy_32_tokens_match_transformers_generate(smollm2, reference):
    prompt = torch.tensor(smollm2.tokenizer.apply_chat_template(MESSAGES))
    ours = greedy_with_cache(smollm2.model, prompt, 32)
    theirs = reference.generate(
        prompt[None], max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0, min_new_tokens=32
    )[0, len(prompt) :].tolist()
    assert ours == theirs
    assert len(set(ours)) > 5  # a real answer, not a degenerate repetition
