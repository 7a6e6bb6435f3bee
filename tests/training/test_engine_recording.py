"""Recording in the serving engine: prompts of recorded requests land in the store, sliced out of batched and
chunked prefills, and replaying them gives the recompute gradients. Decode steps record nothing."""

from __future__ import annotations

import torch

from alchemist.config import EngineConfig, RecordConfig
from alchemist.engine import LLMEngine
from alchemist.engine.sequence import SamplingParams
from alchemist.model.loader import build_model
from alchemist.model.lora import LoraAdapter
from tests.engine.helpers import char_tokenizer
from tests.training.recording import record_alone
from tests.training.test_replay import max_rel_l2, recompute_grads, replay_grads


def test_engine_records_requested_prompts_in_batched_chunked_prefill(tiny_dirs):
    model = build_model(tiny_dirs["llama-gqa-untied"], torch.float32)
    engine = LLMEngine(
        model,
        char_tokenizer(5),
        EngineConfig(max_num_seqs=4, max_num_batched_tokens=24, max_model_len=256),
        RecordConfig(policy="requested", dtype="float32"),
    )
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
    engine = LLMEngine(
        model,
        char_tokenizer(5),
        EngineConfig(max_num_seqs=3, max_num_batched_tokens=32, max_model_len=128, block_size=4, num_kv_blocks=24),
        RecordConfig(policy="all", dtype="float32"),
    )
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
