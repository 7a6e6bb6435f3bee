"""Trainer: replay when a fresh record covers the prompt, recompute otherwise, and the counters say which."""

from __future__ import annotations

import pytest
import torch

from alchemist.activations.store import ActivationStore
from alchemist.model.loader import build_model
from alchemist.training.recompute import recompute_loss
from alchemist.training.slices import run_to_end
from alchemist.training.trainer import Sample, Trainer, TrainerConfig
from tests.training.recording import record_alone
from tests.training.test_replay import lora_with_nonzero_b


@pytest.fixture
def setup(tiny_dirs):
    # float64: replay and recompute run their matmuls at different row counts, which oneDNN may block differently
    # (on an AMX Xeon it does); in fp32 that rounding, amplified by Adam's first step on near-zero gradients, moved
    # weights by more than 1e-6. In float64 what remains is the math, which must agree.
    model = build_model(tiny_dirs["llama-gqa-untied"], torch.float64)
    adapter = lora_with_nonzero_b(model)
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, 256, (40,), generator=g)
    response = torch.randint(0, 256, (10,), generator=g)
    store = ActivationStore(budget_bytes=1 << 30)
    store.put(record_alone(model, adapter, prompt, record_id="resp-1", version=adapter.version))
    sample = Sample(prompt.tolist(), response.tolist(), record_id="resp-1")
    return model, adapter, store, sample


def test_fresh_record_replays_then_stale_record_recomputes(setup):
    model, adapter, store, sample = setup
    trainer = Trainer(model, adapter, store, TrainerConfig(max_staleness=0))
    first = run_to_end(trainer.step_slices([sample]))
    assert (first.replayed, first.recomputed) == (1, 0)
    assert adapter.version == 1
    second = run_to_end(trainer.step_slices([sample]))  # the record saw version 0; the adapter is at 1 now
    assert (second.replayed, second.recomputed) == (0, 1)
    assert (trainer.stats.replayed, trainer.stats.recomputed, trainer.stats.stale) == (1, 1, 1)


def test_staleness_bound_allows_lagging_records(setup):
    model, adapter, store, sample = setup
    trainer = Trainer(model, adapter, store, TrainerConfig(max_staleness=2))
    results = [run_to_end(trainer.step_slices([sample])) for _ in range(4)]
    assert [r.replayed for r in results] == [1, 1, 1, 0]
    assert trainer.stats.staleness_used == {0: 1, 1: 1, 2: 1} and trainer.stats.stale == 1


def test_missing_or_mismatched_record_recomputes(setup):
    model, adapter, store, sample = setup
    trainer = Trainer(model, adapter, store)
    other_prompt = Sample([7, *sample.prompt_ids[1:]], sample.response_ids, record_id="resp-1")
    unknown = Sample(sample.prompt_ids, sample.response_ids, record_id="evicted")
    result = run_to_end(trainer.step_slices([other_prompt, unknown]))
    assert (result.replayed, result.recomputed) == (0, 2)
    assert trainer.stats.missing == 2 and store.stats.misses == 1


def test_replay_step_equals_recompute_step(setup):
    """One optimizer step on replayed gradients lands on the same weights as one on recomputed gradients."""
    model, adapter, store, sample = setup
    import copy

    twin = copy.deepcopy(adapter)
    run_to_end(Trainer(model, adapter, store).step_slices([sample]))
    run_to_end(Trainer(model, twin, None).step_slices([sample]))
    for (name, a), b in zip(adapter.named_parameters(), twin.parameters(), strict=True):
        assert torch.allclose(a, b, rtol=0, atol=1e-6), name


def test_training_lowers_the_sample_loss(setup):
    model, adapter, store, sample = setup
    prompt, response = torch.tensor(sample.prompt_ids), torch.tensor(sample.response_ids)
    with torch.no_grad():
        before = recompute_loss(model, adapter, prompt, response).item()
    trainer = Trainer(model, adapter, store, TrainerConfig(lr=1e-2, max_staleness=100))
    for _ in range(5):
        run_to_end(trainer.step_slices([sample]))
    with torch.no_grad():
        after = recompute_loss(model, adapter, prompt, response).item()
    assert trainer.stats.replayed == 5
    assert after < before - 0.5


def test_a_step_refused_by_its_screen_drops_the_gradients_and_does_not_update(setup):
    """The poisoning guard's veto: ``screen`` sees each sample's (loss, replayed) before the update; False leaves
    the adapter, its version and the optimizer as they were."""
    model, adapter, store, sample = setup
    before = {name: p.detach().clone() for name, p in adapter.named_parameters()}
    trainer = Trainer(model, adapter, store)
    seen = []
    step = run_to_end(trainer.step_slices([sample], screen=lambda passes: seen.append(passes) or False))
    assert not step.updated and step.passes == seen[0] and seen[0][0][1]  # replayed, then refused
    assert adapter.version == 0 and trainer.stats.steps == 0 and not trainer.optimizer.state
    assert all(p.grad is None for p in adapter.parameters())
    for name, p in adapter.named_parameters():
        assert torch.equal(p, before[name]), name
    accepted = run_to_end(trainer.step_slices([sample], screen=lambda passes: True))
    assert accepted.updated and adapter.version == 1 and trainer.stats.steps == 1
