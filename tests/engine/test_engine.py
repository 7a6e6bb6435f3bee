"""The engine on a tiny random model: batching, chunking and preemption change nothing; abort, stops, limits."""

from __future__ import annotations

import threading

import pytest

from alchemist.engine import QueueFullError, SamplingParams
from alchemist.engine.engine import OVER_OBJECTIVE_STRETCH
from alchemist.engine.scheduler import MIN_PREFILL_TOKENS
from alchemist.engine.step_cost import StepCost
from tests.engine.helpers import random_prompts, run_to_end

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
LENGTHS = [3, 70, 17, 41, 1, 96, 33, 9]  # with a budget of 32, four of them are prefilled in chunks


def alone(make_engine, prompts, params, **config) -> list[list[int]]:
    """Each prompt through its own engine, one at a time: the reference."""
    return [make_engine(**config).generate([p], params)[0].output_token_ids for p in prompts]


def test_batched_and_chunked_equals_alone(make_engine):
    prompts = random_prompts(LENGTHS)
    engine = make_engine(max_num_batched_tokens=32, max_num_seqs=8)
    outs = engine.generate(prompts, GREEDY)
    assert [o.output_token_ids for o in outs] == alone(make_engine, prompts, GREEDY)
    assert all(o.finish_reason == "length" and len(o.output_token_ids) == 24 for o in outs)
    assert engine.stats().num_prompt_tokens == sum(LENGTHS)
    assert engine.stats().num_generation_tokens == 8 * 24


def test_preemption_recomputes_to_the_same_tokens(make_engine):
    prompts = random_prompts([30, 12, 25, 40, 8, 19], seed=1)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    # 6 requests needing up to 20 blocks of 4 tokens each share 24 blocks: they cannot all stay resident.
    engine = make_engine(block_size=4, num_kv_blocks=24, max_num_seqs=6, max_num_batched_tokens=16)
    outs = engine.generate(prompts, params)
    assert engine.stats().num_preemptions > 0
    assert [o.output_token_ids for o in outs] == alone(make_engine, prompts, params)
    assert engine.block_manager.num_free_blocks == 24 and engine.block_manager.num_free_slots == 6


def test_seeded_sampling_ignores_batch_neighbours(make_engine):
    prompt = random_prompts([20], seed=2)[0]
    seeded = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    reference = make_engine().generate([prompt], seeded)[0].output_token_ids
    engine = make_engine(max_num_batched_tokens=16)
    neighbours = random_prompts([50, 7, 33], seed=3)
    others = [SamplingParams(max_tokens=20, temperature=1.0, seed=s, ignore_eos=True) for s in (1, 2)] + [GREEDY]
    outs = engine.generate([*neighbours, prompt], [*others, seeded])
    assert outs[-1].output_token_ids == reference
    reseeded = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, top_k=50, seed=99, ignore_eos=True)
    assert make_engine().generate([prompt], reseeded)[0].output_token_ids != reference


def test_abort_frees_slot_and_blocks(make_engine):
    engine = make_engine(max_num_seqs=2, max_num_batched_tokens=64)
    prompts = random_prompts([40, 20, 10], seed=4)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, GREEDY)
    engine.step()
    assert engine.stats().num_running == 2 and engine.stats().num_waiting == 1
    held = engine.block_manager.num_blocks - engine.block_manager.num_free_blocks
    engine.abort("r0")  # running: its slot (0) and blocks come back before abort returns
    assert engine.block_manager.num_free_slots == 1
    assert engine.block_manager.num_blocks - engine.block_manager.num_free_blocks == held - 3  # 40 tokens: 3 blocks
    engine.abort("r2")  # still waiting
    engine.abort("no-such-request")
    assert engine.stats().num_waiting == 0
    outs = run_to_end(engine)
    assert [o.finish_reason for o in outs["r0"]] == ["abort"] and [o.finish_reason for o in outs["r2"]] == ["abort"]
    assert outs["r1"][-1].finish_reason == "length"
    assert engine.block_manager.usage == 0.0 and engine.block_manager.num_free_slots == 2


def test_max_tokens_and_context_limit(make_engine):
    engine = make_engine(max_model_len=32)
    prompt = random_prompts([20], seed=5)[0]
    out = engine.generate([prompt], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))[0]
    assert len(out.output_token_ids) == 5 and out.finish_reason == "length"
    out = engine.generate([prompt], SamplingParams(temperature=0, ignore_eos=True))[0]  # max_tokens None
    assert len(out.output_token_ids) == 12 and out.finish_reason == "length"


def test_stop_token_ids_and_eos(make_engine):
    prompt = random_prompts([12], seed=6)[0]
    tokens = make_engine().generate([prompt], GREEDY)[0].output_token_ids
    k = 6
    stop_id = tokens[k]
    first = tokens.index(stop_id)
    params = SamplingParams(max_tokens=24, temperature=0, stop_token_ids=[stop_id])
    out = make_engine().generate([prompt], params)[0]
    assert out.output_token_ids == tokens[: first + 1] and out.finish_reason == "stop"
    full_text = make_engine().tokenizer.decode(tokens[:first])
    assert out.text == full_text  # the stop token's own text is not added
    # The same token as the tokenizer's EOS: stops unless ignore_eos.
    eos_params = SamplingParams(max_tokens=24, temperature=0)
    assert make_engine(eos_id=stop_id).generate([prompt], eos_params)[0].output_token_ids == tokens[: first + 1]
    assert make_engine(eos_id=stop_id).generate([prompt], GREEDY)[0].output_token_ids == tokens


def test_stop_strings_cut_the_text_and_are_never_streamed(make_engine):
    prompt = random_prompts([12], seed=7)[0]
    full = make_engine().generate([prompt], GREEDY)[0].text
    stop = full[10:13]
    cut = full.find(stop)
    engine = make_engine()
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=["never-there", stop])
    engine.add_request("s", prompt, params)
    outs = run_to_end(engine)["s"]
    assert outs[-1].finish_reason == "stop" and outs[-1].text == full[:cut]
    assert "".join(o.new_text for o in outs) == full[:cut]
    assert all(o.text == "".join(p.new_text for p in outs[: i + 1]) for i, o in enumerate(outs))
    assert len(outs[-1].output_token_ids) < 24  # generation stopped early


def test_logprobs(make_engine):
    prompt = random_prompts([10], seed=8)[0]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=3)
    engine = make_engine()
    engine.add_request("lp", prompt, params)
    outs = run_to_end(engine)["lp"]
    logprobs = [lp for o in outs for lp in o.logprobs]
    assert [lp.token_id for lp in logprobs] == outs[-1].output_token_ids
    for lp in logprobs:
        assert len(lp.top) == 3 and lp.top[0][0] == lp.token_id and lp.top[0][1] == pytest.approx(lp.logprob)
        assert lp.logprob <= 0 and lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1]
    assert make_engine().generate([prompt], GREEDY)[0].logprobs is None


def test_timings(make_engine):
    engine = make_engine()
    out = engine.generate(random_prompts([10], seed=9), SamplingParams(max_tokens=8, temperature=0))[0]
    t = out.timings
    assert t is not None and 0 <= t.queue_s <= t.ttft_s <= t.e2e_s and t.tpot_s >= 0


def test_bad_requests_raise_value_error_naming_the_problem(make_engine):
    engine = make_engine(max_model_len=64, block_size=4, num_kv_blocks=8)
    ok = SamplingParams(max_tokens=4)
    cases = [
        ("", [1, 2], ok, "request_id"),
        ("a", [], ok, "prompt_ids"),
        ("a", [1, 256], ok, "prompt_ids"),
        ("a", [1] * 64, ok, "prompt_ids"),
        ("a", [1] * 40, SamplingParams(max_tokens=30), "max_tokens"),
        ("a", [1] * 20, SamplingParams(max_tokens=20), "num_kv_blocks"),
        ("a", [1, 2], {"max_tokens": 4}, "params"),
    ]
    for request_id, prompt, params, field in cases:
        with pytest.raises(ValueError, match=field):
            engine.add_request(request_id, prompt, params)
    engine.add_request("a", [1, 2], ok)
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request("a", [1, 2], ok)


def test_waiting_queue_is_bounded(make_engine):
    engine = make_engine(max_waiting=2)
    engine.add_request("a", [1], GREEDY)
    engine.add_request("b", [1], GREEDY)
    with pytest.raises(QueueFullError):
        engine.add_request("c", [1], GREEDY)
    engine.step()  # both admitted: the queue has room again
    engine.add_request("c", [1], GREEDY)


def test_requests_from_another_thread_while_stepping(make_engine):
    """add_request/abort from the caller's thread while a background thread steps, as the HTTP server does."""
    engine = make_engine(max_num_seqs=4, max_num_batched_tokens=32)
    prompts = random_prompts([25, 6, 48, 13, 30, 2], seed=10)
    results: dict[str, list[int]] = {}
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            for out in engine.step():
                if out.finished:
                    results[out.request_id] = out.output_token_ids if out.finish_reason != "abort" else None

    thread = threading.Thread(target=loop)
    thread.start()
    try:
        for i, p in enumerate(prompts):
            engine.add_request(f"t{i}", p, GREEDY)
        engine.abort("t2")
        while len(results) < len(prompts):
            threading.Event().wait(0.01)
    finally:
        stop.set()
        thread.join()
    expected = alone(make_engine, prompts, GREEDY)
    for i in range(len(prompts)):
        if i != 2 or results["t2"] is not None:  # t2 may have finished before the abort landed
            assert results[f"t{i}"] == expected[i]
    assert not engine.has_unfinished() and engine.block_manager.usage == 0.0


def test_config_defaults_resolve_from_the_model(make_engine):
    engine = make_engine()
    assert engine.config.max_model_len == 512  # min(tiny model's max_position_embeddings, 4096)
    assert engine.config.num_kv_blocks == 16 * 512 // 16


def test_prefill_beside_decodes_is_chunked_by_the_objective_to_the_same_tokens(make_engine):
    """With a TPOT objective that no step can keep (1 ns), a prompt that arrives while another request decodes is
    prefilled MIN_PREFILL_TOKENS a step, beside the decode; without one, in one step. The greedy fp32 tokens of both
    requests are the same either way."""
    first, long = random_prompts([5, 150], seed=6)

    def serve(**config) -> tuple[dict[str, list[int]], list[tuple[int, int, float]]]:
        engine = make_engine(max_num_batched_tokens=256, max_num_seqs=4, **config)
        # rates that leave a step beside one decode no more than the minimum, whatever this machine's steps take
        engine.step_cost = fixed_step_cost(row_s=0.003, token_s=0.001)
        engine.add_request("first", first, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
        engine.step()  # its prefill, alone: the whole budget
        engine.add_request("long", long, GREEDY)
        tokens: dict[str, list[int]] = {}
        steps = []
        while engine.has_unfinished():
            for out in engine.step():
                tokens[out.request_id] = list(out.output_token_ids)
            steps.append(engine.last_step)
        return tokens, steps

    capped, capped_steps = serve(slo_tpot_s=1e-9)
    whole, whole_steps = serve()
    prefills = [(d, p) for d, p, _ in capped_steps if p > 0]
    assert prefills == [(1, MIN_PREFILL_TOKENS)] * 4 + [(1, 150 - 4 * MIN_PREFILL_TOKENS)]  # beside first's decode
    assert [(d, p) for d, p, _ in whole_steps if p > 0] == [(1, 150)]
    assert capped == whole and len(capped["first"]) == 40 and len(capped["long"]) == 24


def fixed_step_cost(row_s: float, token_s: float) -> StepCost:
    """A step cost estimate that knows these rates and learns nothing more."""
    cost = StepCost()
    cost.observe(num_decodes=1, num_prefill_tokens=0, seconds=row_s)
    cost.observe(num_decodes=0, num_prefill_tokens=1, seconds=token_s)
    cost.observe = lambda *step: None  # type: ignore[method-assign]
    return cost


def test_decodes_that_outlast_the_objective_still_leave_prefill_a_share_of_their_time(make_engine):
    """Beside decodes whose estimate fits the TPOT objective, prefill takes what is left of it; beside decodes that
    alone outlast it (more than the objective was derived on), what lasts OVER_OBJECTIVE_STRETCH times their time,
    not the scheduler's minimum."""
    row_s, token_s = 2**-8, 2**-13  # 3.9 ms a decode row, 0.12 ms a prefill token: exact in binary
    engine = make_engine(max_num_batched_tokens=256, max_num_seqs=4, slo_tpot_s=2**-5)
    engine.step_cost = fixed_step_cost(row_s, token_s)
    assert engine._prefill_cap(4) == (2**-5 - 4 * row_s) / token_s == 128
    engine.set_tpot_objective(2**-7)  # 4 decodes alone take twice that
    assert engine._prefill_cap(4) == (OVER_OBJECTIVE_STRETCH - 1) * 4 * row_s / token_s == 64
    assert engine._prefill_cap(4) > MIN_PREFILL_TOKENS
