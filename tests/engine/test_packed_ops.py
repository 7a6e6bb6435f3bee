"""The packed bf16 fast path computes what the plain path computes: the model's hidden states and logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from alchemist.config import EngineConfig
from alchemist.engine import LLMEngine, SamplingParams
from alchemist.engine.packed_ops import (
    ROW_MULTIPLE,
    PackedLinearOps,
    onednn_packs_bf16,
    pack,
    packed_linear,
    packed_linear_supported,
)
from alchemist.engine.runner import ModelRunner
from alchemist.model.attention import AttentionMetadata
from alchemist.model.loader import build_model
from tests.engine.helpers import char_tokenizer, random_prompts


@pytest.fixture(scope="module")
def bf16_model(tiny_dirs):
    return build_model(tiny_dirs["qwen2-bias"], torch.bfloat16)  # q/k/v bias: the packed linear's bias path


def cpu_packs_bf16() -> bool:
    """Asked of oneDNN directly, not of the code under test: does packing a bf16 weight work on this CPU?"""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.ones(32, 8, dtype=torch.bfloat16), None)
    except (RuntimeError, AttributeError):
        return False
    return True


def test_packed_forward_and_lm_head_equal_plain(bf16_model):
    """Where this CPU packs bf16 weights, the runner takes the packed path and it computes what the plain one
    does; where it cannot (oneDNN's bf16 path needs AVX-512 or AVX-NE-CONVERT), the runner computes plainly."""
    model = bf16_model
    runner = ModelRunner(model, EngineConfig(max_num_seqs=1).resolve(model.config.max_position_embeddings))
    assert packed_linear_supported(model) == cpu_packs_bf16()
    if not cpu_packs_bf16():
        assert not isinstance(runner.ops, PackedLinearOps) and runner._packed_lm_head is None
        return
    ids = torch.tensor(random_prompts([37], seed=11)[0])
    meta = AttentionMetadata.single(len(ids))
    with torch.inference_mode():
        plain = model(ids, torch.arange(len(ids)), meta)
        packed = model(ids, torch.arange(len(ids)), meta, PackedLinearOps(model))
        torch.testing.assert_close(packed, plain, rtol=0, atol=0)
        torch.testing.assert_close(runner.logits(packed), model.logits(plain), rtol=0, atol=0)
    assert isinstance(runner.ops, PackedLinearOps)


def test_bf16_engine_generates(bf16_model):
    engine = LLMEngine(bf16_model, char_tokenizer(), EngineConfig(max_num_seqs=16, max_num_batched_tokens=16))
    outs = engine.generate(random_prompts([5, 30]), SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert [len(o.output_token_ids) for o in outs] == [8, 8]


def test_packed_linear_pads_rows_without_changing_them():
    """Rows are padded to a multiple of ROW_MULTIPLE (oneDNN keeps a primitive per shape): every row count gives
    bitwise the rows the stock linear gives, bias included, whether or not it needed padding."""
    if not cpu_packs_bf16():
        assert not onednn_packs_bf16()
        return
    torch.manual_seed(0)
    weight, bias = torch.randn(96, 64, dtype=torch.bfloat16), torch.randn(96, dtype=torch.bfloat16)
    packed = pack(weight)
    for rows in [*range(1, 2 * ROW_MULTIPLE + 2), 100, 511, 512]:
        x = torch.randn(rows, 64, dtype=torch.bfloat16)
        out = packed_linear(x, packed, bias)
        assert out.shape == (rows, 96) and out.is_contiguous()
        torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=0, atol=0)
