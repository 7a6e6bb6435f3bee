"""Samples trained together (one walk, one forward) give the gradients of the same samples trained one at a time."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from alchemist.activations.store import ActivationStore
from alchemist.model.loader import build_model
from alchemist.training.losses import Targets
from alchemist.training.recompute import LayerSplitPass, recompute_loss, recompute_losses, sample_values
from alchemist.training.replay import ReplaySample, replay_backward_slices
from alchemist.training.slices import run_to_end
from alchemist.training.trainer import Sample, Trainer, TrainerConfig
from tests.tiny_models import TINY_VARIANTS
from tests.training.recording import record_alone
from tests.training.test_replay import flat, grads_of, lora_with_nonzero_b, max_rel_l2

# (prompt, response) lengths: a one-token prompt (no record rows), a one-token response, and different lengths
SHAPES = [(45, 13), (1, 6), (20, 1), (33, 9)]


def make_samples(model, adapter, seed=3):
    """Random samples of SHAPES, each with an fp32 record of its prompt and the last one an anchor (KL targets)."""
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    samples = []
    for p_len, r_len in SHAPES:
        prompt, response = (
            torch.randint(0, vocab, (p_len,), generator=g),
            torch.randint(0, vocab, (r_len,), generator=g),
        )
        samples.append((prompt, response, record_alone(model, adapter, prompt), None))
    prompt, response, record, _ = samples[-1]
    top = torch.randn(len(response), vocab, generator=g).log_softmax(-1).topk(5, dim=-1)
    samples[-1] = prompt, response, record, Targets(top.indices, top.values)
    return samples


SCALES = [0.5, 1.0, 0.25, 2.0]


def one_at_a_time(model, adapter, samples, replay: bool):
    adapter.zero_grad(set_to_none=True)
    losses = []
    for (prompt, response, record, targets), scale in zip(samples, SCALES, strict=True):
        if replay:
            sample = ReplaySample(prompt, response, record.layers.__getitem__, loss_scale=scale, targets=targets)
            losses += run_to_end(replay_backward_slices(model, adapter, [sample]))
        else:
            loss = recompute_loss(model, adapter, prompt, response, targets)
            (loss * scale).backward()
            losses.append(loss.item())
    return losses, grads_of(adapter)


@pytest.mark.parametrize("variant", sorted(TINY_VARIANTS))
def test_replayed_together_equals_one_at_a_time(tiny_dirs, variant):
    model = build_model(tiny_dirs[variant], torch.float32)
    adapter = lora_with_nonzero_b(model)
    samples = make_samples(model, adapter)
    alone_losses, alone = one_at_a_time(model, adapter, samples, replay=True)
    _, recomputed = one_at_a_time(model, adapter, samples, replay=False)

    adapter.zero_grad(set_to_none=True)
    group = [ReplaySample(prompt, response, record.layers.__getitem__, loss_scale=scale, targets=targets)
             for (prompt, response, record, targets), scale in zip(samples, SCALES, strict=True)]  # fmt: skip
    slices, pauses = replay_backward_slices(model, adapter, group), 0
    while True:
        try:
            next(slices)
        except StopIteration as done:
            losses = done.value
            break
        pauses += 1
    together = grads_of(adapter)
    # serving may take a turn between any two layers of the live forward and of the walk, in the middle of each
    # walk layer (after its MLP), and around each sample's loss (the LM head): never more than one of these at a time
    layers = model.config.num_layers
    assert pauses == (layers - 1) + len(group) + 1 + (2 * layers - 1)

    assert losses == pytest.approx(alone_losses, rel=1e-6)
    assert max_rel_l2(alone, together) <= 1e-5
    assert max_rel_l2(recomputed, together) <= 1e-5


def test_recomputed_together_equals_one_at_a_time(tiny_dirs):
    model = build_model(tiny_dirs["llama-gqa-untied"], torch.float32)
    adapter = lora_with_nonzero_b(model)
    samples = make_samples(model, adapter)
    alone_losses, alone = one_at_a_time(model, adapter, samples, replay=False)
    adapter.zero_grad(set_to_none=True)
    losses = recompute_losses(model, adapter, [(p, r, t) for p, r, _, t in samples])
    sum(loss * scale for loss, scale in zip(losses, SCALES, strict=True)).backward()
    assert [loss.item() for loss in losses] == pytest.approx(alone_losses, rel=1e-6)
    assert max_rel_l2(alone, grads_of(adapter)) <= 1e-5


@pytest.mark.parametrize("variant", sorted(TINY_VARIANTS))
def test_the_layer_split_recompute_equals_one_backward_of_the_whole_graph(tiny_dirs, variant):
    """The online trainer's recompute (``LayerSplitPass``: the graph cut at every layer, a layer per slice both ways)
    gives the losses and gradients of one forward and one backward over the same samples, and pauses after every
    layer of each."""
    model = build_model(tiny_dirs[variant], torch.float32)
    adapter = lora_with_nonzero_b(model)
    samples = [(p, r, t) for p, r, _, t in make_samples(model, adapter)]
    adapter.zero_grad(set_to_none=True)
    whole = recompute_losses(model, adapter, samples)
    sum(loss * scale for loss, scale in zip(whole, SCALES, strict=True)).backward()
    reference = grads_of(adapter)

    adapter.zero_grad(set_to_none=True)
    split = LayerSplitPass(model, adapter, [(p, r) for p, r, _ in samples])
    forward, pauses = split.forward_slices(), 0
    while True:
        try:
            next(forward)
            pauses += 1
        except StopIteration as done:
            hidden = done.value
            break
    losses = sample_values(model, hidden, samples)
    pauses += sum(1 for _ in split.backward_slices(sum(v * s for v, s in zip(losses, SCALES, strict=True))))
    assert pauses == 2 * model.config.num_layers
    assert [v.item() for v in losses] == pytest.approx([v.item() for v in whole], rel=1e-6)
    assert max_rel_l2(reference, grads_of(adapter)) <= 1e-6


def test_trainer_groups_replay_and_recompute_samples(tiny_dirs):
    """A step of 5 samples in groups of 3 (records stored for three, one record missing, one sample without a
    record id) lands on the weights of the same step taken one sample at a time, counts each sample once and
    releases every record it pinned."""
    model = build_model(tiny_dirs["llama-gqa-untied"], torch.float32)
    adapter, twin = lora_with_nonzero_b(model), lora_with_nonzero_b(model)
    store = ActivationStore(budget_bytes=1 << 30)
    samples = []
    for i, (prompt, response, record, _) in enumerate(make_samples(model, adapter)):
        if i != 2:  # sample 2's record is never stored: it is recomputed inside a group that replays
            store.put(dataclasses.replace(record, record_id=f"resp-{i}"))
        samples.append(Sample(prompt.tolist(), response.tolist(), record_id=f"resp-{i}"))
    samples.append(Sample(samples[0].prompt_ids, samples[0].response_ids[:5]))  # no record id: recomputed

    grouped = Trainer(model, adapter, store, TrainerConfig(group_size=3))
    result = run_to_end(grouped.step_slices(samples))
    reference = run_to_end(Trainer(model, twin, store, TrainerConfig(group_size=1)).step_slices(samples))

    assert (result.replayed, result.recomputed) == (reference.replayed, reference.recomputed) == (3, 2)
    assert grouped.stats.samples == 5 and grouped.stats.missing == 1
    assert result.loss == pytest.approx(reference.loss, rel=1e-6)
    ours, theirs = flat(dict(adapter.named_parameters())), flat(dict(twin.named_parameters()))
    assert (ours - theirs).abs().max().item() <= 1e-6
    assert all(store.evict(f"resp-{i}") for i in (0, 1, 3))  # nothing left pinned


def test_groups_are_capped_in_samples_and_in_rows(tiny_dirs):
    """A group holds at most group_size samples and group_max_tokens rows (P + R - 1 each), in order; a sample
    with more rows than the cap is a group alone; 0 lifts the cap."""
    model = build_model(tiny_dirs["llama-gqa-untied"], torch.float32)
    adapter = lora_with_nonzero_b(model)

    def sample(rows):  # a sample of ``rows`` rows: P + R - 1
        return Sample([1] * (rows - 3), [2] * 4)

    samples = [sample(n) for n in (10, 10, 30, 5, 5, 5, 5, 50, 4)]

    def cut(**config):
        return [(g.start, g.stop) for g in Trainer(model, adapter, None, TrainerConfig(**config)).groups(samples)]

    assert cut(group_size=4, group_max_tokens=0) == [(0, 4), (4, 8), (8, 9)]
    assert cut(group_size=4, group_max_tokens=40) == [(0, 2), (2, 5), (5, 7), (7, 8), (8, 9)]  # 40 rows fit in 40
    assert cut(group_size=2, group_max_tokens=20) == [(0, 2), (2, 3), (3, 5), (5, 7), (7, 8), (8, 9)]
    assert cut(group_size=1, group_max_tokens=1) == [(i, i + 1) for i in range(len(samples))]
    with pytest.raises(ValueError, match="group_max_tokens"):
        TrainerConfig(group_max_tokens=-1)
