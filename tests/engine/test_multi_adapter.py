"""Several adapters in one engine, and in one step, on a tiny random model (fp32): each request gets what it gets
served alone with its adapter, the prefix cache never lends keys/values across adapters, names are checked, and a
step whose rows share one adapter still takes the merged weights."""

from __future__ import annotations

import pytest
import torch

from alchemist.engine import LLMEngine, RequestOutput, SamplingParams
from alchemist.engine.adapter_rows import AdapterRows
from alchemist.engine.sequence import BASE, TokenLogprobs
from alchemist.engine.served_adapter import ServedAdapter
from alchemist.model.lora import LoraAdapter
from tests.engine.helpers import random_adapter, random_prompts, recording_engine, run_to_end
from tests.training.recording import record_alone

WITH_LOGPROBS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=3)


def answer(outs: list[RequestOutput]) -> tuple[list[int], list[TokenLogprobs]]:
    """A request's tokens and every token's logprobs, from all its outputs."""
    return outs[-1].output_token_ids, [lp for out in outs for lp in out.logprobs]


def served(engine: LLMEngine, prompt: list[int], adapter_name: str | None) -> tuple[list[int], list[TokenLogprobs]]:
    """``prompt``'s answer from ``engine`` (run to the end)."""
    engine.add_request("alone", prompt, WITH_LOGPROBS, adapter_name=adapter_name)
    return answer(run_to_end(engine)["alone"])


def alone(make_engine, adapter: LoraAdapter | None, prompt: list[int]) -> tuple[list[int], list[TokenLogprobs]]:
    """``prompt``'s answer from a fresh engine that serves ``adapter`` only (None: the base model)."""
    engine = make_engine()
    if adapter is not None:
        engine.set_adapter(adapter, 1)
    return served(engine, prompt, None)


def assert_same_answer(got, want, request_id: str) -> None:
    """Greedy tokens equal, and their logprobs within 1e-5 (the merge and the separate delta round otherwise)."""
    assert got[0] == want[0], request_id
    for lp, ref in zip(got[1], want[1], strict=True):
        assert abs(lp.logprob - ref.logprob) <= 1e-5, request_id
        assert [t for t, _ in lp.top] == [t for t, _ in ref.top], request_id


def test_a_batch_of_three_adapters_and_the_base_model_answers_each_as_alone(make_engine, tiny_model):
    shared, team_a, team_b = (random_adapter(tiny_model, seed) for seed in (11, 12, 13))
    engine = make_engine(max_num_batched_tokens=24)  # prompts in chunks, beside the decodes of the others
    engine.set_adapter(shared, 1)
    engine.set_adapter(team_a, 4, name="team-a")
    engine.set_adapter(team_b, 2, name="team-b")
    # (request, adapter name, its adapter): two requests of team-a, so that its rows are not one run
    requests = [("s", None, shared), ("a1", "team-a", team_a), ("base", BASE, None), ("b", "team-b", team_b),
                ("a2", "team-a", team_a), ("s2", None, shared)]  # fmt: skip
    prompts = dict(zip((r for r, _, _ in requests), random_prompts([9, 30, 5, 40, 17, 23], seed=21), strict=True))
    steps = []  # per step: (tokens per row group, the adapter names of its sequences)
    run = engine.runner.run

    def run_and_note(batch):
        steps.append((list(batch.num_tokens), {seq.adapter_name for seq in batch.seqs}))
        return run(batch)

    engine.runner.run = run_and_note
    for request_id, name, _ in requests[:4]:
        engine.add_request(request_id, prompts[request_id], WITH_LOGPROBS, adapter_name=name)
    outs = {}
    for _ in range(3):  # the first ones decode when the last ones arrive
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    for request_id, name, _ in requests[4:]:
        engine.add_request(request_id, prompts[request_id], WITH_LOGPROBS, adapter_name=name)
    for request_id, got in run_to_end(engine).items():
        outs.setdefault(request_id, []).extend(got)

    assert engine.runner.num_mixed_steps > 0
    mixed_chunked = [(n, names) for n, names in steps if 1 in n and max(n) > 1 and len(names) >= 3]
    assert mixed_chunked, steps  # a prompt chunk beside decodes, of three adapters or more
    versions = {None: 1, "team-a": 4, "team-b": 2, BASE: 0}
    for request_id, name, adapter in requests:
        assert {(o.adapter_name, o.adapter_version) for o in outs[request_id]} == {(name, versions[name])}
        assert_same_answer(answer(outs[request_id]), alone(make_engine, adapter, prompts[request_id]), request_id)


def test_records_of_a_mixed_step_hold_each_requests_own_prefill(tiny_model):
    """A recorded prompt beside rows of other adapters: its record is the one a plain forward with its adapter
    makes, and it carries the adapter's name and version."""
    engine = recording_engine(tiny_model, max_num_batched_tokens=64)
    shared, team = random_adapter(tiny_model, 14), random_adapter(tiny_model, 15)
    engine.set_adapter(shared, 1)
    engine.set_adapter(team, 3, name="team")
    prompts = dict(zip(("s", "t", "base"), random_prompts([12, 20, 9], seed=22), strict=True))
    names = {"s": None, "t": "team", "base": BASE}
    params = SamplingParams(max_tokens=3, temperature=0)
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, params, adapter_name=names[request_id])
    run_to_end(engine)
    assert engine.runner.num_mixed_steps > 0
    for request_id, adapter, version in (("s", shared, 1), ("t", team, 3), ("base", None, 0)):
        record = engine.store.lookup(request_id)
        assert (record.adapter_name, record.adapter_version) == (names[request_id], version)
        ref = record_alone(tiny_model, adapter, torch.tensor(prompts[request_id]))
        for layer, ref_layer in zip(record.layers, ref.layers, strict=True):
            for name, t in ref_layer.items():
                torch.testing.assert_close(layer[name], t, atol=1e-5, rtol=1e-5, msg=f"{request_id} {name}")


def test_the_prefix_cache_never_serves_a_prefix_across_adapters(make_engine, tiny_model):
    team_a, team_b = random_adapter(tiny_model, 16), random_adapter(tiny_model, 17)
    engine = make_engine()
    engine.set_adapter(team_a, 1, name="a")
    engine.set_adapter(team_b, 1, name="b")  # the same version: the names tell them apart
    prompt = random_prompts([40], seed=23)[0]  # two full blocks of 16 to cache

    def hits() -> int:
        return engine.stats().num_prefix_cache_hits

    first_a = served(engine, prompt, "a")
    under_b = served(engine, prompt, "b")
    assert hits() == 0
    assert_same_answer(under_b, alone(make_engine, team_b, prompt), "b")
    again_a = served(engine, prompt, "a")
    assert hits() == 32  # a's own prefix, two blocks
    assert_same_answer(again_a, first_a, "a again")
    # The base model is version 0 whatever the name: the shared slot unset and BASE share their blocks.
    engine.generate([prompt], WITH_LOGPROBS)
    engine.generate([prompt], WITH_LOGPROBS, adapter_name=BASE)
    assert hits() == 64


def test_adapter_names_are_checked(make_engine, tiny_model):
    engine = make_engine()
    adapter = random_adapter(tiny_model, 18)
    with pytest.raises(ValueError, match="names no adapter"):
        engine.add_request("r", [1, 2, 3], WITH_LOGPROBS, adapter_name="nobody")
    with pytest.raises(ValueError, match="name must be"):
        engine.set_adapter(adapter, 1, name=BASE)
    with pytest.raises(ValueError, match="remove_adapter"):
        engine.set_adapter(None, 0, name="team")
    with pytest.raises(ValueError, match="names no adapter"):
        engine.remove_adapter("team")
    engine.set_adapter(adapter, 1, name="team")
    assert engine.named_adapters == {"team": 1} and engine.adapter_version == 0
    engine.add_request("r", [1, 2, 3], WITH_LOGPROBS, adapter_name="team")


def test_a_removed_adapter_serves_the_requests_already_added(make_engine, tiny_model):
    team = random_adapter(tiny_model, 19)
    engine = make_engine()
    engine.set_adapter(team, 1, name="team")
    prompt = random_prompts([14], seed=24)[0]
    engine.add_request("r", prompt, WITH_LOGPROBS, adapter_name="team")
    outs = engine.step()  # its prefill and first token
    engine.remove_adapter("team")
    with pytest.raises(ValueError, match="names no adapter"):
        engine.add_request("late", prompt, WITH_LOGPROBS, adapter_name="team")
    assert "team" in engine.runner.named  # until its last request is done
    outs += run_to_end(engine)["r"]
    assert_same_answer(answer(outs), alone(make_engine, team, prompt), "r")
    engine.step()  # the step after the last one drops it
    assert engine.named_adapters == {} and engine.runner.named == {}


def test_steps_of_one_adapter_keep_the_merged_weights(make_engine, tiny_model):
    engine = make_engine(max_num_batched_tokens=32)
    engine.set_adapter(random_adapter(tiny_model, 20), 1)
    engine.set_adapter(random_adapter(tiny_model, 21), 1, name="team")
    prompts = random_prompts([12, 30, 7], seed=25)
    engine.generate(prompts, WITH_LOGPROBS)  # steps enough to merge the shared adapter's every layer
    assert engine.runner.merged.complete
    merged = engine.runner.num_merged_steps
    engine.generate(prompts, WITH_LOGPROBS)
    assert engine.runner.num_merged_steps > merged and engine.runner.num_mixed_steps == 0
    merged = engine.runner.num_merged_steps
    engine.generate(prompts, WITH_LOGPROBS, adapter_name="team")  # a named adapter: its delta, never merged
    engine.generate(prompts, WITH_LOGPROBS, adapter_name=BASE)
    assert engine.runner.num_merged_steps == merged and engine.runner.num_mixed_steps == 0


def test_adapter_rows_add_each_adapters_delta_on_its_rows_only(tiny_model):
    """``AdapterRows`` against each adapter's delta on its own rows: runs and gathered rows, base rows zero."""
    a, b = (ServedAdapter(random_adapter(tiny_model, s), tiny_model.dtype, tiny_model.device) for s in (22, 23))
    rows = AdapterRows.of([a, None, b, a], [3, 2, 4, 1], [], tiny_model.device)  # a: rows 0-2 and 9; b: 5-8
    x = torch.randn(10, tiny_model.config.hidden_size)
    got = rows.delta(0, "qkv", x)
    torch.testing.assert_close(got[[0, 1, 2, 9]], a.delta(0, "qkv", x[[0, 1, 2, 9]]), rtol=0, atol=0)
    torch.testing.assert_close(got[5:9], b.delta(0, "qkv", x[5:9]), rtol=0, atol=0)
    assert torch.equal(got[3:5], torch.zeros_like(got[3:5]))
