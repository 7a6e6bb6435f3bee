"""Recording in the serving engine: prompts of recorded requests land in the store, sliced out of batched and
chunked prefills, and replaying them gives the recompute gradients. Decode steps record nothing."""

from __future__ import annotations

import torch

from alchemist.activations.record import COPIED, RECORDED
from alchemist.engine.sequence import SamplingParams
from alchemist.model.loader import build_model
from alchemist.model.lora import LoraAdapter
from tests.engine.helpers import recording_engine
from tests.training.recording import record_alone
from tests.training.test_replay import max_rel_l2, recompute_grads, replay_grads


def test_engine_records_requested_prompts_in_batched_chunked_prefill(tiny_dirs):
    model = build_model(tiny_dirs["llama-gqa-untied"], torch.float32)
    engine = recording_engine(model, max_num_batched_tokens=24, policy="requested", max_model_len=256)
    g = torch.Generator().manual_seed(0)
    prompts = {f"req-{i}": torch.randint(6, 256, (n,), generator=g).tolist() for i, n in enumerate((70, 9, 33, 50))}
    recorded = {"req-0", "req-2"}  # req-0 needs 3+ chunks at 24 tokens a step, beside the others
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, SamplingParams(max_tokens=6, ignore_eos=True, record=rid in recorded))
    while engine.has_unfinished():
        engine.step()
    assert {rid for rid in prompts if rid in engine.store} == recorded
    assert engine.store.stats.records == 2 and engine.recorder.num_recorded == 2

    adapter = LoraAdapter(model.config, seed=0)  # B = 0: the delta is zero, as when the engine served
    for rid in recorded:
        record = engine.store.lookup(rid)
        assert record.prompt_ids == tuple(prompts[rid]) and record.num_tokens == len(prompts[rid])
        prompt = torch.tensor(prompts[rid])
        response = torch.randint(6, 256, (9,), generator=g)
        _, ref = recompute_grads(model, adapter, prompt, response)
        _, got = replay_grads(model, adapter, record, prompt, response)
        assert max_rel_l2(ref, got) <= 1e-5


def test_preempted_request_is_recorded_whole(tiny_dirs):
    model = build_model(tiny_dirs["llama-gqa-untied"], torch.float32)
    engine = recording_engine(model, max_num_batched_tokens=32, max_num_seqs=3, block_size=4, num_kv_blocks=24)
    g = torch.Generator().manual_seed(1)
    prompts = {f"p{i}": torch.randint(6, 256, (30,), generator=g).tolist() for i in range(3)}
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, SamplingParams(max_tokens=40, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert engine.scheduler.num_preemptions > 0
    for rid, prompt in prompts.items():
        record = engine.store.lookup(rid)
        assert record is not None and record.prompt_ids == tuple(prompt)
        # The record equals a fresh recording of the prompt alone (same rows, any chunking).
        alone = record_alone(model, None, torch.tensor(prompt))
        for layer, ref_layer in zip(record.layers, alone.layers, strict=True):
            for name, ref in ref_layer.items():
                assert torch.allclose(layer[name], ref, atol=1e-5, rtol=1e-5), name


def test_recorded_prompt_with_a_cached_prefix_is_computed_whole(tiny_dirs):
    """Prefix caching and recording: a recorded request whose prompt starts with cached blocks bypasses the cache
    (its record must hold every prompt row, the trainer replays them all), so its record is complete and replays to
    the recompute gradients; its own blocks are cached for requests that are not recorded."""
    model = build_model(tiny_dirs["llama-gqa-untied"], torch.float32)
    engine = recording_engine(model, max_num_batched_tokens=32, policy="requested", max_model_len=256)
    g = torch.Generator().manual_seed(4)
    shared = torch.randint(6, 256, (64,), generator=g).tolist()  # 4 full blocks
    prompts = {rid: shared + torch.randint(6, 256, (n,), generator=g).tolist() for rid, n in (("a", 9), ("b", 5))}
    engine.generate([prompts["a"]], SamplingParams(max_tokens=4, ignore_eos=True))  # caches the shared blocks
    before = engine.stats()
    engine.add_request("b", prompts["b"], SamplingParams(max_tokens=4, ignore_eos=True, record=True))
    while engine.has_unfinished():
        engine.step()
    after = engine.stats()
    assert (after.num_prefix_cache_queries, after.num_prefix_cache_hits) == (
        before.num_prefix_cache_queries,
        before.num_prefix_cache_hits,
    )  # not looked up
    record = engine.store.lookup("b")
    assert record.prompt_ids == tuple(prompts["b"]) and record.num_tokens == len(prompts["b"])
    alone = record_alone(model, None, torch.tensor(prompts["b"]))
    for layer, ref_layer in zip(record.layers, alone.layers, strict=True):
        for name, ref in ref_layer.items():
            assert layer[name].shape == ref.shape and torch.allclose(layer[name], ref, atol=1e-5, rtol=1e-5), name
    adapter = LoraAdapter(model.config, seed=0)
    prompt, response = torch.tensor(prompts["b"]), torch.randint(6, 256, (9,), generator=g)
    _, ref = recompute_grads(model, adapter, prompt, response)
    _, got = replay_grads(model, adapter, record, prompt, response)
    assert max_rel_l2(ref, got) <= 1e-5
    # A request that is not recorded still hits: the shared blocks (in a's slot and in b's, both registered).
    engine.generate([prompts["b"] + [7]], SamplingParams(max_tokens=2, ignore_eos=True))
    assert engine.stats().num_prefix_cache_hits == after.num_prefix_cache_hits + 64


def test_prompt_prefilled_whole_is_recorded_without_copies(tiny_dirs):
    """A recorded prompt that makes up (at least 3/4 of) one forward keeps that forward's outputs as its record;
    a small prompt beside it, and a prompt prefilled in chunks, are copied. Either way the record is the prompt's
    rows: equal to a recording of the prompt alone that copied every row, and it replays to exact gradients."""
    model = build_model(tiny_dirs["llama-gqa-untied"], torch.float32)
    engine = recording_engine(model, max_num_batched_tokens=64, max_model_len=256)
    g = torch.Generator().manual_seed(2)
    prompts = {rid: torch.randint(6, 256, (n,), generator=g).tolist() for rid, n in (("a", 40), ("b", 8))}
    for rid, prompt in prompts.items():  # one forward: a's 40 rows and b's 8
        engine.add_request(rid, prompt, SamplingParams(max_tokens=3, ignore_eos=True))
    engine.step()
    kept_per_record = (len(RECORDED) - len(COPIED)) * model.config.num_layers
    assert engine.recorder.num_recorded == 2 and engine.recorder.num_adopted == kept_per_record  # a's, not b's
    prompts["c"] = torch.randint(6, 256, (100,), generator=g).tolist()  # two chunks: copied
    engine.add_request("c", prompts["c"], SamplingParams(max_tokens=3, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert engine.recorder.num_recorded == 3 and engine.recorder.num_adopted == kept_per_record

    adapter = LoraAdapter(model.config, seed=0)
    for rid, prompt in prompts.items():
        record = engine.store.lookup(rid)
        copied = record_alone(model, None, torch.tensor(prompt), keep_outputs=False)
        data_bytes = sum(t.numel() * t.element_size() for layer in record.layers for t in layer.values())
        assert data_bytes == copied.nbytes <= record.nbytes <= data_bytes * 4 / 3  # a holds b's rows too
        for layer, ref_layer in zip(record.layers, copied.layers, strict=True):
            for name, ref in ref_layer.items():
                assert torch.allclose(layer[name], ref, atol=1e-5, rtol=1e-5), (rid, name)
    prompt, response = torch.tensor(prompts["a"]), torch.randint(6, 256, (9,), generator=g)
    _, ref = recompute_grads(model, adapter, prompt, response)
    _, got = replay_grads(model, adapter, engine.store.lookup("a"), prompt, response)
    assert max_rel_l2(ref, got) <= 1e-5


def test_kept_and_copied_records_are_bitwise_equal(tiny_dirs):
    model = build_model(tiny_dirs["llama-gqa-untied"], torch.bfloat16)
    prompt = torch.randint(6, 256, (33,), generator=torch.Generator().manual_seed(3))
    kept = record_alone(model, None, prompt, dtype=torch.bfloat16, keep_outputs=True)
    copied = record_alone(model, None, prompt, dtype=torch.bfloat16, keep_outputs=False)
    assert kept.dtype == copied.dtype == torch.bfloat16 and kept.nbytes == copied.nbytes
    for a, b in zip(kept.layers, copied.layers, strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) and a[n].dtype == b[n].dtype for n in a)
