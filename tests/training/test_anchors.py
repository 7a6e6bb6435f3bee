"""Anchors (alchemist.training.anchors): the KL to the base model on served traffic that keeps a learning model
close to what it was. Its loss and gradient through replay equal recompute's; the pool keeps recent completions
and never one whose prompt got feedback; the online trainer trains on them beside the feedback."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from alchemist.engine import SamplingParams
from alchemist.model.attention import AttentionMetadata, Segment
from alchemist.model.loader import build_model
from alchemist.training.anchors import Anchor, AnchorPool, in_turn, known_fact_anchors, references_slices
from alchemist.training.evaluation import CANARIES
from alchemist.training.losses import Targets, kl_to_targets
from alchemist.training.recompute import recompute_loss
from alchemist.training.replay import ReplaySample, replay_backward_slices
from alchemist.training.slices import run_to_end as run_slices
from tests.engine.helpers import random_prompts, run_to_end
from tests.training.recording import record_alone, record_batched_chunked
from tests.training.test_online import drain, online, serve_and_log
from tests.training.test_replay import grads_of, lora_with_nonzero_b, max_rel_l2


def test_kl_to_targets_is_the_kl_of_the_top_k_and_the_rest():
    g = torch.Generator().manual_seed(0)
    ref, logits = torch.randn(5, 40, generator=g), torch.randn(5, 40, generator=g)
    full = F.log_softmax(ref, -1)
    everything = Targets(torch.arange(40).expand(5, 40), full)
    expected = F.kl_div(F.log_softmax(logits, -1), full, log_target=True, reduction="sum") / 5
    assert kl_to_targets(logits, everything).item() == pytest.approx(expected.item(), rel=1e-5)
    assert kl_to_targets(ref, everything).item() == pytest.approx(0.0, abs=1e-6)  # no distance to itself
    # Top 8: the KL of the distributions coarsened to those 8 tokens and "any other" (a 9th outcome).
    top = full.topk(8, -1)
    q = F.softmax(logits, -1)
    p9 = torch.cat([top.values.exp(), 1 - top.values.exp().sum(-1, keepdim=True)], -1)
    q_top = q.gather(-1, top.indices)
    q9 = torch.cat([q_top, 1 - q_top.sum(-1, keepdim=True)], -1)
    coarse = (p9 * (p9.log() - q9.log())).sum(-1).mean()
    got = kl_to_targets(logits, Targets(top.indices, top.values))
    assert got.item() == pytest.approx(coarse.item(), rel=1e-5)
    assert 0 < got.item() < expected.item()  # coarsening loses information, never adds it
    # Moving mass onto the kept tokens is no longer rewarded: the reference itself is the minimum.
    kept = Targets(top.indices, top.values)
    sharpened = ref.scatter_add(-1, top.indices, torch.full((5, 8), 3.0))
    assert kl_to_targets(sharpened, kept) > kl_to_targets(ref, kept)
    assert kl_to_targets(ref, kept).item() == pytest.approx(0.0, abs=1e-6)


def test_references_are_the_base_models_top_k(tiny_dirs):
    model = build_model(tiny_dirs["llama-gqa-untied"], torch.float32)
    prompt, response = list(range(3, 20)), [5, 9, 11, 2]
    (targets,) = run_slices(references_slices(model, [(prompt, response)], top_k=6))
    assert targets.ids.shape == targets.logprobs.shape == (4, 6)
    # With the adapter off (B = 0 anyway here) the recompute path's KL to its own targets is zero.
    loss = recompute_loss(model, None, torch.tensor(prompt), torch.tensor(response), targets)
    assert loss.item() == pytest.approx(0.0, abs=1e-6)


def test_references_of_several_anchors_in_one_forward_equal_each_alone(tiny_dirs):
    model = build_model(tiny_dirs["llama-gqa-untied"], torch.float32)
    g = torch.Generator().manual_seed(6)
    pairs = [(torch.randint(0, 256, (p,), generator=g).tolist(), torch.randint(0, 256, (r,), generator=g).tolist())
             for p, r in ((17, 4), (1, 3), (30, 1))]  # fmt: skip
    together = run_slices(references_slices(model, pairs, top_k=6))
    for (prompt, response), got in zip(pairs, together, strict=True):
        (alone,) = run_slices(references_slices(model, [(prompt, response)], top_k=6))
        assert got.ids.shape == (len(response), 6)
        assert torch.equal(got.ids, alone.ids)
        assert torch.allclose(got.logprobs, alone.logprobs, rtol=0, atol=1e-5)


def test_references_run_in_slices_of_one_layer_and_equal_the_whole_forward(tiny_dirs):
    # The online trainer computes anchors' references between serving steps: one layer per slice, never the
    # whole forward at once, and the same numbers as the model's plain forward.
    model = build_model(tiny_dirs["llama-gqa-untied"], torch.float32)
    g = torch.Generator().manual_seed(7)
    pairs = [(torch.randint(0, 256, (p,), generator=g).tolist(), torch.randint(0, 256, (r,), generator=g).tolist())
             for p, r in ((12, 5), (20, 2))]  # fmt: skip
    slices, pauses = references_slices(model, pairs, top_k=4), 0
    try:
        while True:
            next(slices)
            pauses += 1
            assert torch.is_grad_enabled()  # no_grad holds inside the slices only
    except StopIteration as done:
        got = done.value
    assert pauses == model.config.num_layers + len(pairs) - 1  # each layer, then each anchor's top-k
    for (prompt, response), targets in zip(pairs, got, strict=True):
        seq = torch.tensor(prompt + response[:-1])
        with torch.no_grad():
            hidden = model(seq, torch.arange(len(seq)), AttentionMetadata([Segment(slot=0, start=0, length=len(seq))]))
        want = F.log_softmax(model.logits(hidden[len(prompt) - 1 :]).float(), dim=-1).topk(4, dim=-1)
        assert not targets.logprobs.requires_grad
        assert torch.equal(targets.ids, want.indices)
        assert torch.allclose(targets.logprobs, want.values, rtol=0, atol=1e-5)


@pytest.mark.parametrize("prefill", ["alone", "batched_chunked"])
def test_anchor_replay_gradients_equal_recompute(tiny_dirs, prefill):
    # float64: the KL of a slightly adapted model is a small difference of large terms, so fp32 rounding that differs
    # between replay's and recompute's matmul shapes (oneDNN blocks them differently on an AMX Xeon) moved it by more
    # than 1e-5 relative. In float64 what remains is the math, which must agree.
    model = build_model(tiny_dirs["llama-gqa-untied"], torch.float64)
    adapter = lora_with_nonzero_b(model)  # the adapted model differs from the base: a non-zero KL and gradient
    g = torch.Generator().manual_seed(4)
    prompt, response = torch.randint(0, 256, (40,), generator=g), torch.randint(0, 256, (11,), generator=g)
    (targets,) = run_slices(references_slices(model, [(prompt.tolist(), response.tolist())], top_k=16))
    if prefill == "alone":
        record = record_alone(model, adapter, prompt)
    else:
        record = record_batched_chunked(model, adapter, prompt, [torch.randint(0, 256, (25,), generator=g)], chunk=16)
    adapter.zero_grad(set_to_none=True)
    loss_ref = recompute_loss(model, adapter, prompt, response, targets)
    loss_ref.backward()
    ref = grads_of(adapter)
    adapter.zero_grad(set_to_none=True)
    sample = ReplaySample(prompt, response, lambda layer: record.layers[layer], targets=targets)
    (loss,) = run_slices(replay_backward_slices(model, adapter, [sample]))
    assert loss_ref.item() > 0
    assert loss == pytest.approx(loss_ref.item(), rel=1e-5)
    assert max_rel_l2(ref, grads_of(adapter)) <= 1e-5


def test_pool_keeps_the_most_recent_and_never_a_prompt_with_feedback():
    pool = AnchorPool(max_size=3)
    for i in range(5):
        pool.offer(Anchor(f"r{i}", [1, 2, i], [7, 8]))
    assert [a.response_id for a in pool.recent(10)] == ["r4", "r3", "r2"]  # newest first, bounded
    pool.offer(Anchor("empty", [1, 2], []))  # nothing served: nothing to stay close on
    assert len(pool) == 3
    pool.exclude("r9", [1, 2, 3])  # feedback on another completion of r3's prompt
    assert [a.response_id for a in pool.recent(10)] == ["r4", "r2"]
    pool.offer(Anchor("r10", [1, 2, 3], [7]))  # the same prompt served again: still excluded
    assert [a.response_id for a in pool.recent(1)] == ["r4"]
    with pytest.raises(ValueError, match="max_size"):
        AnchorPool(max_size=0)


def test_pool_takes_the_most_recent_that_fit_in_the_rows():
    """An anchor's rows: its prompt and its response's first ``max_response`` tokens, less one; one that does not
    fit in what is left is passed over for older ones."""
    pool = AnchorPool()
    for i, (prompt_len, response_len) in enumerate([(3, 2), (2, 9), (10, 2), (4, 4), (2, 2)]):
        pool.offer(Anchor(f"r{i}", list(range(prompt_len)), list(range(response_len))))
    # rows newest first (responses cut to 3): r4 3, r3 6, r2 11, r1 4, r0 4
    assert [a.response_id for a in pool.recent(10, max_rows=13, max_response=3)] == ["r4", "r3", "r1"]
    assert [a.response_id for a in pool.recent(2, max_rows=13, max_response=3)] == ["r4", "r3"]
    assert [a.response_id for a in pool.recent(10, max_rows=2)] == []
    assert len(pool.recent(10)) == 5  # no bound


def test_the_trainer_bounds_its_served_anchors_rows(engine, tmp_path):
    trainer, log, checkpoints = online(engine, tmp_path,
                                       anchors={"samples": 4, "max_tokens": 3, "max_rows": 12},
                                       stopping={"epochs": 1})  # fmt: skip
    for i in range(4):  # rows 4 + 3 - 1 = 6 each: two fit
        trainer.anchors.offer(Anchor(f"a{i}", [1, 2, 3, 4 + i], [5, 6, 7, 8]))
    serve_and_log(engine, log, 2)
    drain(trainer)
    assert trainer.stats.anchor_samples == 2 and checkpoints.versions()[-1].metrics["anchors"] == 2


def test_online_trainer_trains_anchors_beside_the_feedback(engine, tmp_path):
    trainer, log, checkpoints = online(engine, tmp_path, anchors={"samples": 3}, stopping={"epochs": 1},
                                       queue={"batch_size": 2})  # fmt: skip
    prompts = random_prompts([30, 33, 36, 39], seed=9)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"a{i}", prompt, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    outputs = run_to_end(engine)
    for i, prompt in enumerate(prompts):
        trainer.anchors.offer(Anchor(f"a{i}", prompt, outputs[f"a{i}"][-1].output_token_ids))
    seqs = serve_and_log(engine, log, 2)
    drain(trainer)
    s = trainer.stats
    assert s.samples == 2 and s.anchor_samples == 3 and s.anchor_tokens == 15
    assert s.anchor_replayed == 3  # their prompts were recorded by the version being trained (0)
    # The first step starts at the base model (B = 0): the anchors' KL is zero there, and it is measured.
    assert s.last_anchor_kl == pytest.approx(0.0, abs=1e-6)
    assert checkpoints.versions()[-1].metrics["anchors"] == 3
    assert checkpoints.versions()[-1].log_position == seqs[-1]
    # Anchors are the most recent completions; feedback on one of them takes its prompt out of the pool.
    assert [a.response_id for a in trainer.anchors.recent(10)] == ["a3", "a2", "a1", "a0"]
    log.append(
        response_id="a3", kind="sft", correction="x", prompt_token_ids=prompts[3], response_token_ids=[1, 2],
        output_token_ids=[1, 2], adapter_version=engine.adapter_version, recorded=True,
    )  # fmt: skip
    trainer.has_work()  # reads the log
    assert [a.response_id for a in trainer.anchors.recent(10)] == ["a2", "a1", "a0"]


def test_anchors_take_turns_over_a_batchs_steps(engine, tmp_path):
    """With ``turn`` k each step trains every k-th of the batch's anchors, the next ones each step: every anchor
    once in k steps, and again after; the batch's metrics count its anchors, the stats each pass."""
    assert [in_turn(list(range(7)), step, 3) for step in range(4)] == [[0, 3, 6], [1, 4], [2, 5], [0, 3, 6]]
    assert in_turn(list(range(3)), 5, 1) == [0, 1, 2]
    # Two replicas in lockstep, each with the same list (the known facts): at each step they take other ones, as
    # many together as one process takes.
    for step in range(4):
        mine, theirs = (in_turn(list(range(8)), step, 2, replicas=2, rank=rank) for rank in (0, 1))
        assert not set(mine) & set(theirs) and len(mine) + len(theirs) == len(in_turn(list(range(8)), step, 2))
    assert in_turn(list(range(8)), 0, 1, replicas=2, rank=1) == [1, 3, 5, 7]  # turn 1: half each
    trainer, log, checkpoints = online(engine, tmp_path, anchors={"samples": 5, "turn": 2}, stopping={"epochs": 3})
    for i in range(5):
        trainer.anchors.offer(Anchor(f"a{i}", [1, 2, 3, 4 + i], [5, 6, 7 + i]))
    serve_and_log(engine, log, 2)
    drain(trainer)
    assert trainer.stats.steps == 3 and trainer.stats.anchor_samples == 3 + 2 + 3  # a4 a2 a0, a3 a1, a4 a2 a0
    assert trainer.stats.anchor_tokens == 3 * 8 and checkpoints.versions()[-1].metrics["anchors"] == 5
    assert all(a.targets is not None for a in trainer.anchors.recent(5))  # targets once per anchor, for all steps


def test_a_step_of_anchors_in_turn_is_the_step_of_those_anchors_alone(engine, tmp_path):
    """The cheaper path is the old one over fewer anchors: a step with ``turn`` 2 over five anchors updates the
    adapter exactly as a step over its three (every second: a4, a2, a0) with all of them every step."""
    for name in "abc":
        (tmp_path / name).mkdir()
    sections = {"stopping": {"epochs": 1}, "trainer": {"replay": False}}
    in_turn_, _, _ = online(engine, tmp_path / "a", anchors={"samples": 5, "turn": 2}, **sections)
    alone, log_b, _ = online(engine, tmp_path / "b", anchors={"samples": 3}, **sections)
    for i in range(5):
        anchor = Anchor(f"a{i}", [1, 2, 3, 4 + i], [5, 6, 7 + i])
        in_turn_.anchors.offer(anchor)
        if i % 2 == 0:
            alone.anchors.offer(Anchor(anchor.response_id, anchor.prompt_ids, anchor.response_ids))
    for seq in serve_and_log(engine, in_turn_.log, 2):  # the same feedback in both logs
        e = in_turn_.log.get(seq)
        log_b.append(response_id=e.response_id, kind=e.kind, correction=e.correction,
                     prompt_token_ids=e.prompt_token_ids, response_token_ids=e.response_token_ids,
                     output_token_ids=e.output_token_ids, adapter_version=0, recorded=False)  # fmt: skip
    drain(in_turn_), drain(alone)
    assert in_turn_.stats.anchor_samples == alone.stats.anchor_samples == 3
    a, b = in_turn_.adapter.state_dict(), alone.adapter.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    initial = online(engine, tmp_path / "c", anchors={"samples": 3}, **sections)[0].adapter.state_dict()
    assert any(not torch.equal(a[k], initial[k]) for k in a)  # the step moved the adapter


def test_no_anchors_when_their_weight_is_zero(engine, tmp_path):
    trainer, log, _ = online(engine, tmp_path, anchors={"weight": 0.0}, stopping={"epochs": 1})
    trainer.anchors.offer(Anchor("a0", [1, 2, 3], [4, 5]))
    serve_and_log(engine, log, 2)
    drain(trainer)
    assert trainer.stats.samples == 2 and trainer.stats.anchor_samples == 0


def test_an_anchor_is_its_responses_first_tokens(engine, tmp_path):
    trainer, log, _ = online(engine, tmp_path, anchors={"samples": 2, "max_tokens": 3}, stopping={"epochs": 1})
    trainer.anchors.offer(Anchor("a0", [1, 2, 3, 4], [5, 6, 7, 8, 9, 10]))
    trainer.anchors.offer(Anchor("a1", [1, 2, 3, 5], [5, 6]))
    serve_and_log(engine, log, 2)
    drain(trainer)
    assert trainer.stats.anchor_samples == 2 and trainer.stats.anchor_tokens == 3 + 2
    assert [a.targets.ids.shape[0] for a in trainer.anchors.recent(2)] == [2, 3]  # targets for what is trained


def test_known_facts_anchor_each_step_in_turn(engine, tmp_path):
    """Beside the served anchors, each batch anchors on the next ``anchor_known_facts`` well-known facts (trained by
    recompute: they have no record), taking the list in turn and starting over at its end."""
    trainer, log, _ = online(engine, tmp_path, anchors={"samples": 2, "known_facts": 10},
                             stopping={"epochs": 1}, queue={"batch_size": 2})  # fmt: skip
    known = trainer.batch_anchors.known_facts
    assert len(known) == 24 and all(a.prompt_ids and a.response_ids for a in known)
    trainer.anchors.offer(Anchor("a0", [1, 2, 3, 4], [5, 6]))
    for batch in range(3):  # facts 0-9, 10-19, then 20-23 and 0-5
        serve_and_log(engine, log, 2, seed=batch)
        drain(trainer)
        used = [a.targets is not None for a in known]  # a known fact's targets are computed when first used
        assert used == [i < 10 * (batch + 1) for i in range(24)] if batch < 2 else all(used)
    assert trainer.stats.anchor_samples == 3 * (1 + 10) and trainer.batch_anchors.known_next == 6


def test_known_facts_are_not_the_gates_canaries(smollm2_tokenizer):
    """The known facts keep the model's answers to real facts; the gate's canaries measure them: disjoint sets."""
    anchors = known_fact_anchors(smollm2_tokenizer)
    canaries = {tuple(smollm2_tokenizer.user_prompt(question)) for question, _, _ in CANARIES}
    assert len(anchors) == 24 and not canaries & {tuple(a.prompt_ids) for a in anchors}
    assert all(a.response_ids[-1] == smollm2_tokenizer.end_of_turn_token_id for a in anchors)
