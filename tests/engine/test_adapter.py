"""Serving a LoRA adapter on a tiny random model: swaps land between steps, the base model comes back exactly,
the served copy is frozen, records and outputs carry the version of their prefill, and the bf16 packed path
adds the delta too. (Exactness against ``Llama.forward`` on the real model: test_adapter_real.py.)"""

from __future__ import annotations

import threading

import pytest
import torch

from alchemist.config import EngineConfig
from alchemist.engine import LLMEngine, RequestOutput, SamplingParams
from alchemist.engine.packed_ops import PackedLinearOps, packed_linear_supported
from alchemist.engine.served_adapter import FP32_MAX_ROWS, ServedAdapter
from alchemist.model.loader import build_model
from alchemist.model.lora import FUSED_PARTS, LoraAdapter, LoraConfig, part_shapes
from tests.engine.helpers import (
    char_tokenizer,
    greedy_reference,
    random_adapter,
    random_prompts,
    recording_engine,
    run_to_end,
)
from tests.training.recording import record_alone

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
WITH_LOGPROBS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=3)


def tokens(outs: list[RequestOutput]) -> list[list[int]]:
    return [o.output_token_ids for o in outs]


def new_tokens(outs: list[RequestOutput]) -> list[int]:
    return [t for out in outs for t in out.new_token_ids]


def test_swap_takes_effect_at_the_next_step(make_engine, tiny_model):
    prompt = random_prompts([23], seed=7)[0]
    a, b = random_adapter(tiny_model, 1), random_adapter(tiny_model, 2)
    engine = make_engine()
    engine.set_adapter(a, 1)
    engine.add_request("r", prompt, GREEDY)
    got = new_tokens(engine.step())  # the prefill, with a
    got += new_tokens(engine.step())

    # A swap asked for while a step runs (from another thread) waits for the step to end.
    run = engine.runner.run

    def run_with_a_swap_arriving(batch):
        swapper = threading.Thread(target=engine.set_adapter, args=(b, 2))
        swapper.start()
        swapper.join()
        assert engine.adapter_version == 2 and engine.runner.adapter_version == 1
        return run(batch)

    engine.runner.run = run_with_a_swap_arriving
    got += new_tokens(engine.step())  # still a
    engine.runner.run = run
    outs = run_to_end(engine)["r"]
    got += new_tokens(outs)

    only_a = greedy_reference(tiny_model, prompt, 16, [a])
    # Forwards 0..2 ran with a; from forward 3 on, b continues over the keys/values a computed.
    assert got == greedy_reference(tiny_model, prompt, 16, [a, a, a, b])
    assert got[:3] == only_a[:3] and got != only_a
    assert {o.adapter_version for o in outs} == {1}  # the version of its prefill, after the swap too


def test_base_model_comes_back_exactly(make_engine, tiny_model):
    # No prefix cache: the second base run then computes every row as the first did. From the cache it computes only
    # a prompt's last row, a matmul of another shape, which oneDNN may block (and round) differently: on an AMX Xeon
    # it does, by an ulp. Serving the cache under the right version is tests/engine/test_prefix_cache.py's.
    engine = make_engine(max_num_batched_tokens=32, enable_prefix_caching=False)
    prompts = random_prompts([12, 40, 7], seed=8)
    base = engine.generate(prompts, WITH_LOGPROBS)
    engine.set_adapter(random_adapter(tiny_model, 3), 1)
    adapted = engine.generate(prompts, WITH_LOGPROBS)
    assert engine.adapter_version == 1 and {o.adapter_version for o in adapted} == {1}
    engine.set_adapter(None, 0)
    again = engine.generate(prompts, WITH_LOGPROBS)
    assert engine.adapter_version == 0 and {o.adapter_version for o in base + again} == {0}
    assert all(t != u for t, u in zip(tokens(adapted), tokens(base), strict=True))
    assert tokens(again) == tokens(base)
    assert [o.logprobs for o in again] == [o.logprobs for o in base]  # bitwise: same floats


def test_the_served_copy_is_frozen(make_engine, tiny_model):
    engine = make_engine(max_num_batched_tokens=32)
    prompts = random_prompts([12, 40, 7], seed=9)
    adapter = random_adapter(tiny_model, 4)
    engine.set_adapter(adapter, 1)
    theirs = {p.untyped_storage().data_ptr() for p in adapter.parameters()}
    served = engine.runner.adapter.tensors()
    assert not any(t.requires_grad or t.untyped_storage().data_ptr() in theirs for t in served)
    engine.generate(prompts, WITH_LOGPROBS)  # steps enough to merge every layer: outputs are those of the merge
    assert engine.runner.merged.complete
    first = engine.generate(prompts, WITH_LOGPROBS)
    with torch.no_grad():  # what an optimizer step does to the trainer's own adapter
        for p in adapter.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    later = engine.generate(prompts, WITH_LOGPROBS)
    assert tokens(later) == tokens(first) and [o.logprobs for o in later] == [o.logprobs for o in first]
    engine.set_adapter(adapter, 2)
    assert tokens(engine.generate(prompts, WITH_LOGPROBS)) != tokens(first)


def test_records_and_outputs_carry_the_version_of_their_prefill(tiny_model):
    engine = recording_engine(tiny_model, max_num_batched_tokens=16)
    a, b = random_adapter(tiny_model, 5), random_adapter(tiny_model, 6)
    prompts = dict(zip(("base", "a", "a-chunked", "b"), random_prompts([9, 12, 40, 14], seed=10), strict=True))
    engine.add_request("base", prompts["base"], GREEDY)
    outs = run_to_end(engine)
    engine.set_adapter(a, 3)
    engine.add_request("a", prompts["a"], GREEDY)
    engine.step()  # "a" prefilled whole (12 tokens of the 16-token budget): decoding from now on
    engine.add_request("a-chunked", prompts["a-chunked"], GREEDY)
    engine.step()  # "a" decodes, "a-chunked" gets its first 15 prompt tokens with a
    engine.set_adapter(b, 4)  # both continue with b
    engine.add_request("b", prompts["b"], GREEDY)
    outs |= run_to_end(engine)

    expected = {"base": 0, "a": 3, "a-chunked": 3, "b": 4}
    assert {rid: {o.adapter_version for o in outs[rid]} for rid in expected} == {k: {v} for k, v in expected.items()}
    assert {rid: engine.store.lookup(rid).adapter_version for rid in expected} == expected
    # The adapter runs in the recorded prefill: the record is the one a plain forward with it makes.
    for rid, adapter in (("base", None), ("a", a), ("b", b)):
        ref = record_alone(tiny_model, adapter, torch.tensor(prompts[rid]))
        for layer, ref_layer in zip(engine.store.lookup(rid).layers, ref.layers, strict=True):
            for name, t in ref_layer.items():
                torch.testing.assert_close(layer[name], t, atol=1e-5, rtol=1e-5, msg=f"{rid} {name}")


def test_bf16_packed_path_adds_the_delta(tiny_dirs):
    """A bf16 engine serves the delta exactly: on the packed linears where this CPU packs bf16 weights
    (tests/engine/test_packed_ops.py), on plain ones where it cannot."""
    model = build_model(tiny_dirs["qwen2-bias"], torch.bfloat16)  # q/k/v bias: the packed linear's bias path
    engine = LLMEngine(model, char_tokenizer(), EngineConfig(max_num_seqs=16, max_num_batched_tokens=16))
    assert isinstance(engine.runner.ops, PackedLinearOps) == packed_linear_supported(model)
    adapter = random_adapter(model, 7)
    prompts = random_prompts([5, 30], seed=11)
    base = engine.generate(prompts, GREEDY)
    engine.set_adapter(adapter, 1)
    served = engine.generate(prompts, GREEDY)
    # The packed linears equal F.linear bitwise, so the reference (plain ops, same bf16 delta) is exact here.
    assert tokens(served) == [greedy_reference(model, p, 16, [engine.runner.adapter]) for p in prompts]
    assert all(t != u for t, u in zip(tokens(served), tokens(base), strict=True))


def test_set_adapter_refuses_bad_versions_and_foreign_adapters(make_engine, tiny_model, tiny_dirs):
    engine = make_engine()
    adapter = random_adapter(tiny_model, 8)
    with pytest.raises(ValueError, match="version must be 0 for the base model"):
        engine.set_adapter(None, 3)
    with pytest.raises(ValueError, match="version 0 means the base model"):
        engine.set_adapter(adapter, 0)
    with pytest.raises(ValueError, match="version must be an integer"):
        engine.set_adapter(adapter, -1)
    with pytest.raises(ValueError, match="LoraAdapter"):
        engine.set_adapter(object(), 1)
    other = build_model(tiny_dirs["llama-mha-tied"], torch.float32).config  # 4 KV heads instead of 2
    with pytest.raises(ValueError, match="another shape"):
        engine.set_adapter(LoraAdapter(other), 1)
    assert engine.adapter_version == 0 and engine.runner.adapter is None


@pytest.mark.parametrize("targets", [None, ("q_proj", "v_proj", "down_proj")])
def test_served_delta_equals_the_adapters(tiny_model, targets):
    config = LoraConfig(r=4, alpha=12.0) if targets is None else LoraConfig(r=4, alpha=12.0, target_modules=targets)
    adapter = LoraAdapter(tiny_model.config, config, seed=9)
    with torch.no_grad():
        for b in adapter.B.values():
            b.normal_()
    served = ServedAdapter(adapter, tiny_model.dtype, tiny_model.device)
    shapes = part_shapes(tiny_model.config)
    for layer in range(tiny_model.config.num_layers):
        for name, parts in FUSED_PARTS.items():
            x = torch.randn(5, shapes[parts[0]][0])
            want, got = adapter.delta(layer, name, x), served.delta(layer, name, x)
            if want is None:
                assert got is None
            else:  # fp32 rounding apart (another summation order); zero columns where a part is not targeted
                assert (got - want).abs().max() <= 1e-6 * want.abs().max()
                assert torch.equal(got == 0, want == 0)


def test_bf16_served_delta_of_many_rows_runs_in_bf16_close_to_fp32(tiny_model):
    """A bf16 model's delta: in fp32 for few rows (a decode step), in bf16 from FP32_MAX_ROWS rows (a prefill
    chunk), and then within bf16 rounding of the fp32 delta."""
    adapter = LoraAdapter(tiny_model.config, LoraConfig(r=4, alpha=12.0), seed=9)
    with torch.no_grad():
        for b in adapter.B.values():
            b.normal_()
    exact = ServedAdapter(adapter, torch.float32, tiny_model.device)
    served = ServedAdapter(adapter, torch.bfloat16, tiny_model.device)
    shapes = part_shapes(tiny_model.config)
    for name, parts in FUSED_PARTS.items():
        for rows in (FP32_MAX_ROWS - 1, FP32_MAX_ROWS, 200):
            x = torch.randn(rows, shapes[parts[0]][0]).bfloat16()
            want, got = exact.delta(0, name, x.float()), served.delta(0, name, x)
            assert got.dtype == torch.bfloat16
            if rows < FP32_MAX_ROWS:  # the fp32 delta, rounded once
                assert torch.equal(got, want.bfloat16())
            else:  # A, xa and the delta each rounded to bf16: not the fp32 delta's rounding, within a few ulps
                assert not torch.equal(got, want.bfloat16())
                assert (got.float() - want).abs().max() <= 2**-6 * want.abs().max()
