"""Preference ranks (alchemist.training.rank_split): in a step that mixes corrections and preferences, the
corrections' ranks get exactly the corrections' gradients and the preference ranks exactly the preferences'; the
protected directions leave the preference ranks alone; the online trainer builds the split adapter."""

from __future__ import annotations

import pytest
import torch

from alchemist.activations.store import ActivationStore
from alchemist.model.loader import build_model
from alchemist.model.lora import LoraAdapter, LoraConfig
from alchemist.training.lineage import adapter_config
from alchemist.training.objectives import PreferenceTerm
from alchemist.training.protected import ProtectedSubspace
from alchemist.training.rank_split import RankSplit
from alchemist.training.slices import run_to_end
from alchemist.training.trainer import Sample, Trainer, TrainerConfig
from tests.training.recording import record_alone
from tests.training.test_online import drain, online, serve_and_log

R, PREFERENCE_R = 6, 2


@pytest.fixture(scope="module")
def model(tiny_dirs):
    return build_model(tiny_dirs["llama-gqa-untied"], torch.float32)


def _adapter(model) -> LoraAdapter:
    adapter = LoraAdapter(model.config, LoraConfig(r=R, alpha=2.0 * R), seed=0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for b in adapter.B.values():
            b.copy_(torch.randn(b.shape, generator=g) * 0.02)
    return adapter


def _samples(model, adapter, store) -> tuple[list[Sample], list[float]]:
    """Two corrections (the first replayed from its record) around two KTO ratings, as a mixed step has them."""
    g = torch.Generator().manual_seed(5)
    ids = lambda n: torch.randint(3, 256, (n,), generator=g).tolist()  # noqa: E731
    prompt = ids(30)
    store.put(record_alone(model, adapter, torch.tensor(prompt), record_id="c1", version=adapter.version))
    up = PreferenceTerm("kto", ref_logp=-40.0, weight=0.5, desirable=True, kl=0.1)
    down = PreferenceTerm("kto", ref_logp=-35.0, weight=0.5, desirable=False, kl=0.1)
    samples = [Sample(prompt, ids(8), "c1"), Sample(ids(20), ids(9), term=up), Sample(ids(25), ids(7), term=down),
               Sample(ids(18), ids(6))]  # fmt: skip
    return samples, [0.5, 0.0, 0.0, 0.5]


def _grads(model, adapter, store, samples, scales, split: bool) -> dict[str, torch.Tensor]:
    trainer = Trainer(model, adapter, store, TrainerConfig())
    if split:
        trainer.split = RankSplit(adapter, PREFERENCE_R)
    adapter.zero_grad(set_to_none=True)
    run_to_end(trainer.backward_slices(samples, scales))
    grads = {name: p.grad.clone() for name, p in adapter.named_parameters()}
    adapter.zero_grad(set_to_none=True)
    return grads


def test_each_kind_of_sample_trains_only_its_ranks(model):
    adapter = _adapter(model)
    store = ActivationStore(budget_bytes=1 << 30)
    samples, scales = _samples(model, adapter, store)
    split = RankSplit(adapter, PREFERENCE_R)
    assert Trainer(model, adapter, store).groups(samples) == [slice(0, 4)]
    trainer = Trainer(model, adapter, store)
    trainer.split = split
    assert trainer.groups(samples) == [slice(0, 1), slice(1, 3), slice(3, 4)]  # never two kinds in one group

    mixed = _grads(model, adapter, store, samples, scales, split=True)
    corrections = _grads(model, adapter, store, [samples[0], samples[3]], [0.5, 0.5], split=False)
    preferences = _grads(model, adapter, store, samples[1:3], [0.0, 0.0], split=False)
    for name, grad in mixed.items():
        for preference, expected in ((False, corrections[name]), (True, preferences[name])):
            ours, theirs = _block(split, name, grad, preference), _block(split, name, expected, preference)
            assert theirs.abs().max() > 0, name  # each kind moves its ranks
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7, msg=name)


def _block(split: RankSplit, name: str, t: torch.Tensor, preference: bool) -> torch.Tensor:
    """One kind's ranks of an adapter parameter (or its gradient): rows of an A, columns of a B."""
    ranks = slice(split.shared_r, split.r) if preference else slice(0, split.shared_r)
    return split.a_rows(t, preference) if name.startswith("A.") else t[:, ranks]


def test_the_protected_directions_leave_the_preference_ranks_alone(model):
    adapter = _adapter(model)
    split = RankSplit(adapter, PREFERENCE_R)
    before = {key: a.detach().clone() for key, a in adapter.A.items()}
    g = torch.Generator().manual_seed(3)
    bases = {}
    for key, a in adapter.A.items():
        bases[key] = torch.linalg.qr(torch.randn(a.shape[1], 4, generator=g))[0]
    ProtectedSubspace(bases).project_(adapter, split)
    for key, a in adapter.A.items():
        assert torch.equal(split.a_rows(a, True), split.a_rows(before[key], True)), key
        assert (split.a_rows(a, False) @ bases[key]).abs().max() < 1e-5, key
        assert not torch.equal(split.a_rows(a, False), split.a_rows(before[key], False))
    with pytest.raises(ValueError):
        RankSplit(adapter, R)


def test_the_online_trainer_adds_the_preference_ranks_at_the_same_scale(engine, tmp_path):
    trainer, _, _ = online(engine, tmp_path)
    config = trainer.config.adapter
    assert config.preference_r == 8  # the default
    assert trainer.adapter.config.r == config.lora_r + 8 and trainer.trainer.split is not None
    assert trainer.adapter.config.scaling == config.lora_alpha / config.lora_r
    assert adapter_config(type(config)(preference_r=0)).r == config.lora_r
    plain, _, _ = online(engine, tmp_path / "plain", adapter={"preference_r": 0})
    assert plain.trainer.split is None and plain.adapter.config.r == config.lora_r


def test_a_data_dir_saved_before_the_preference_ranks_restarts_serving_the_same(engine, tmp_path):
    """Upgrading: versions saved with the shared ranks alone become the first ranks of the split adapter (the
    preference ranks' B zero, so every delta is as it was) and training goes on from them."""
    old, log, checkpoints = online(engine, tmp_path, adapter={"preference_r": 0})
    serve_and_log(engine, log, 2)
    drain(old)
    saved = checkpoints.serving().version
    assert saved > 0 and old.adapter.config.r == old.config.adapter.lora_r

    new, log, checkpoints = online(engine, tmp_path)  # the defaults, on the same data dir: resumes
    r = new.config.adapter.lora_r
    assert new.version == saved and new.adapter.config.r == r + new.config.adapter.preference_r
    fresh = LoraAdapter(new.adapter.model_config, new.adapter.config, seed=new.config.adapter.seed)
    x = torch.randn(5, engine.model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for key in new.adapter.B:
            assert new.adapter.B[key][:, r:].abs().max() == 0, key
            assert torch.equal(new.adapter.B[key][:, :r], old.adapter.B[key]), key
        for key, a in new.adapter.A.items():
            assert torch.equal(a.view(-1, new.adapter.config.r, a.shape[-1])[:, :r],
                               old.adapter.A[key].view(-1, r, a.shape[-1])), key  # fmt: skip
            preference_r = new.config.adapter.preference_r
            assert torch.equal(RankSplit(new.adapter, preference_r).a_rows(a, True),
                               RankSplit(fresh, preference_r).a_rows(fresh.A[key], True)), key  # fmt: skip
        for layer in range(engine.model.config.num_layers):
            torch.testing.assert_close(new.adapter.delta(layer, "qkv", x), old.adapter.delta(layer, "qkv", x))
    moments = new.trainer.optimizer.state_dict()["state"]
    params = list(new.adapter.parameters())
    assert moments and all(state["exp_avg"].shape == params[i].shape for i, state in moments.items())
    first_b = next(i for i, (name, _) in enumerate(new.adapter.named_parameters()) if name.startswith("B."))
    assert moments[first_b]["exp_avg"][:, r:].abs().max() == 0 and moments[first_b]["exp_avg"][:, :r].abs().max() > 0

    serve_and_log(engine, log, 2, seed=1)  # and it trains on
    drain(new)
    assert checkpoints.serving().version > saved and new.adapter.config.r == r + new.config.adapter.preference_r
