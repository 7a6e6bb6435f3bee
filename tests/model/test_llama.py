"""Our Llama-family model against transformers' reference implementation (test-only use of its model code)."""

from __future__ import annotations

import pytest
import torch
import transformers

from alchemist.model.attention import AttentionMetadata
from alchemist.model.loader import build_model
from tests.tiny_models import TINY_VARIANTS


@pytest.mark.parametrize("variant", sorted(TINY_VARIANTS))
def test_logits_match_transformers(tiny_dirs, variant):
    hf_dir = tiny_dirs[variant]
    ref = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    ours = build_model(hf_dir, torch.float32)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (100,), generator=g)  # past original_max_position_embeddings: scaling matters
    with torch.no_grad():
        expected = ref(ids[None]).logits[0]
        hidden = ours(ids, torch.arange(len(ids)), AttentionMetadata.single(len(ids)))
        got = ours.logits(hidden)
    assert (got - expected).abs().max().item() <= 1e-4
