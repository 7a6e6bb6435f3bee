"""Serving the adapter merged into the weights (``alchemist.engine.merged_adapter``), on the tiny random model:
the merge takes one layer per step and is used only once complete; merged forwards are those of a model whose
weights are ``W + scaling * B A`` and agree with the separate delta to rounding; a recording forward keeps the base
weights and the delta, so records stay base outputs; untargeted projections keep the base weights; a merge made
beforehand in slices (the online trainer's publish) is served whole."""

from __future__ import annotations

import copy

import pytest
import torch

from alchemist.engine import LLMEngine, SamplingParams
from alchemist.engine.merged_adapter import MergedLinearOps
from alchemist.engine.served_adapter import ServedAdapter
from alchemist.model.attention import AttentionMetadata
from alchemist.model.lora import FUSED_PARTS, LoraAdapter, LoraConfig
from alchemist.model.seam import COMPUTE
from tests.engine.helpers import (
    greedy_reference,
    random_adapter,
    random_prompts,
    recording_engine,
    run_to_end,
)
from tests.training.recording import record_alone

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def count_merged_calls(engine: LLMEngine) -> list[int]:
    """Counts the projections the served merge computes from now on (one counter, in a list)."""
    merged, calls = engine.runner.merged, [0]
    linear = merged.linear

    def counted(*args):
        calls[0] += 1
        return linear(*args)

    merged.linear = counted
    return calls


def merged_model(model, adapter: LoraAdapter):
    """A copy of ``model`` whose targeted fused projections are W + scaling * B A (PEFT's merge), by hand."""
    merged = copy.deepcopy(model)
    r, scaling = adapter.config.r, adapter.config.scaling
    with torch.no_grad():
        for layer in range(model.config.num_layers):
            for name, parts in FUSED_PARTS.items():
                weight, row = getattr(merged.layers[layer], f"{name}_weight"), 0
                a = adapter.A.get(f"{layer}_{name}")
                for part in parts:
                    width = adapter.shapes[part][1]
                    if part in adapter.targeted(name):
                        j = adapter.targeted(name).index(part)
                        ba = adapter.B[f"{layer}_{part}"] @ a[j * r : (j + 1) * r]
                        weight[row : row + width] += scaling * ba.to(weight.dtype)
                    row += width
    return merged


@pytest.mark.parametrize("targets", [None, ("q_proj", "v_proj", "down_proj")])
def test_merged_forward_is_the_merged_models(tiny_model, targets):
    config = LoraConfig() if targets is None else LoraConfig(target_modules=targets)
    adapter = LoraAdapter(tiny_model.config, config, seed=3)
    with torch.no_grad():
        for b in adapter.B.values():
            b.normal_(std=0.05)
    ops = MergedLinearOps(tiny_model, ServedAdapter(adapter, tiny_model.dtype, tiny_model.device), COMPUTE, False)
    for _ in range(tiny_model.config.num_layers):
        assert not ops.complete
        ops.merge_next()
    assert ops.complete
    if targets is not None:  # o and gate_up are not targeted: the base weights project them
        assert {name for (_, name) in ops._weights} == {"qkv", "down"}
    ids = torch.tensor(random_prompts([20], seed=1)[0])
    pos, meta = torch.arange(len(ids)), AttentionMetadata.single(len(ids))
    with torch.inference_mode():
        got = tiny_model(ids, pos, meta, ops, None)
        want = merged_model(tiny_model, adapter)(ids, pos, meta)
        delta = tiny_model(ids, pos, meta, COMPUTE, adapter)
        base = tiny_model(ids, pos, meta)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # The merge and the separate delta agree to fp32 rounding, far below what the adapter changes.
    assert (got - delta).abs().max() < 1e-4 * (delta - base).abs().max()


def test_the_engine_merges_a_layer_per_step_then_serves_the_merge(make_engine, tiny_model):
    adapter = random_adapter(tiny_model, 11)
    engine = make_engine(max_num_batched_tokens=32)
    engine.set_adapter(adapter, 1)
    prompt = random_prompts([9], seed=2)[0]
    engine.add_request("r", prompt, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    progress = []
    while engine.has_unfinished():
        engine.step()
        progress.append(engine.runner.merged.num_merged)
    num_layers = tiny_model.config.num_layers
    assert progress[: num_layers + 1] == [*range(1, num_layers + 1), num_layers]
    # Once merged, a request's tokens are the merged model's, and (the two agreeing to rounding) the adapter's.
    calls = count_merged_calls(engine)
    engine.add_request("again", prompt, GREEDY)
    again = run_to_end(engine)["again"][-1].output_token_ids
    assert calls[0] == GREEDY.max_tokens * num_layers * 4  # every forward, every projection
    assert again == greedy_reference(tiny_model, prompt, GREEDY.max_tokens, [adapter])
    assert again == greedy_reference(merged_model(tiny_model, adapter), prompt, GREEDY.max_tokens, [None])


def test_records_stay_base_outputs_after_the_merge(tiny_model):
    engine = recording_engine(tiny_model, max_num_batched_tokens=64)
    adapter = random_adapter(tiny_model, 12)
    engine.set_adapter(adapter, 1)
    first, second = random_prompts([10, 30], seed=3)
    engine.add_request("first", first, GREEDY)
    run_to_end(engine)
    assert engine.runner.merged.complete
    calls = count_merged_calls(engine)
    engine.add_request("second", second, GREEDY)  # recorded while the merged weights serve every other forward
    engine.step()  # the recorded prefill: base weights and the delta
    assert calls[0] == 0
    run_to_end(engine)
    assert calls[0] == (GREEDY.max_tokens - 1) * tiny_model.config.num_layers * 4  # the decode steps: merged
    ref = record_alone(tiny_model, adapter, torch.tensor(second))
    for layer, ref_layer in zip(engine.store.lookup("second").layers, ref.layers, strict=True):
        for name, t in ref_layer.items():
            torch.testing.assert_close(layer[name], t, atol=1e-5, rtol=1e-5, msg=name)


def test_a_swap_starts_the_merge_over_and_the_base_model_needs_none(make_engine, tiny_model):
    engine = make_engine()
    engine.set_adapter(random_adapter(tiny_model, 13), 1)
    engine.generate(random_prompts([5], seed=4), GREEDY)
    old = engine.runner.merged
    assert old.complete
    engine.set_adapter(random_adapter(tiny_model, 14), 2)
    engine.step()  # installs the new adapter
    assert engine.runner.merged is not old and not engine.runner.merged.complete
    engine.set_adapter(None, 0)
    engine.step()
    assert engine.runner.merged is None and engine.runner.adapter is None


def test_without_merging_the_delta_serves_every_forward(make_engine, tiny_model):
    adapter = random_adapter(tiny_model, 15)
    merged, separate = make_engine(), make_engine(merge_adapter=False)
    prompt = random_prompts([9], seed=5)[0]
    for engine in (merged, separate):
        engine.set_adapter(adapter, 1)
        engine.generate([prompt], GREEDY)
    assert merged.runner.merged.complete and separate.runner.merged is None
    reference = greedy_reference(tiny_model, prompt, GREEDY.max_tokens, [adapter])
    assert [o.output_token_ids for o in separate.generate([prompt], GREEDY)] == [reference]


def test_a_merge_made_in_slices_serves_whole_from_the_step_after_the_last(make_engine, tiny_model):
    old, new = random_adapter(tiny_model, 16), random_adapter(tiny_model, 17)
    engine = make_engine()
    engine.set_adapter(old, 1)
    prompt = random_prompts([9], seed=6)[0]
    engine.generate([prompt], GREEDY)
    serving = engine.runner.merged
    assert serving.complete
    engine.add_request("during", prompt, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    num_slices = 0
    for _ in engine.set_adapter_slices(new, 2):  # the stepping thread's other work between slices: steps
        num_slices += 1
        engine.step()
        assert engine.runner.merged is serving and engine.adapter_version == 1  # the old merge serves meanwhile
    assert num_slices == tiny_model.config.num_layers
    assert engine.adapter_version == 2
    engine.step()  # the swap: complete at once, no merge steps after it
    assert engine.runner.merged is not serving and engine.runner.merged.complete
    run_to_end(engine)
    calls = count_merged_calls(engine)
    again = engine.generate([prompt], GREEDY)[0].output_token_ids
    assert calls[0] == GREEDY.max_tokens * tiny_model.config.num_layers * 4  # every forward merged at once
    assert again == greedy_reference(tiny_model, prompt, GREEDY.max_tokens, [new])
