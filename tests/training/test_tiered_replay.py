"""Replay from records that went down the store's tiers: exact gradients, corrupt files recomputed, hedging."""

from __future__ import annotations

import copy
import json
import struct

import pytest
import torch

from alchemist.activations import disk
from alchemist.activations.store import ActivationStore
from alchemist.training.hedge import CostModel
from alchemist.training.trainer import Sample, Trainer, TrainerConfig
from tests.training.recording import record_alone


@pytest.fixture(scope="module")
def sample_ids():
    g = torch.Generator().manual_seed(5)
    return torch.randint(0, 256, (40,), generator=g), torch.randint(0, 256, (10,), generator=g)


def gradients(model, adapter, store, sample, **trainer_kwargs) -> tuple[list[torch.Tensor], Trainer]:
    """One sample's gradients on a fresh copy of the adapter."""
    trainer = Trainer(model, copy.deepcopy(adapter), store, **trainer_kwargs)
    _run(trainer.backward_slices([sample], [1.0]))
    return [p.grad.clone() for p in trainer.adapter.parameters()], trainer


def record_down_to(tier: str, model, adapter, prompt, dtype, tmp_path, record_id="resp") -> ActivationStore:
    """A store whose record ``record_id`` went from device down to ``tier``."""
    record = record_alone(model, adapter, prompt, dtype=dtype, record_id=record_id)
    size = record.nbytes
    budgets = {"host": (size, size + size // 4, 0), "disk": (size, size + size // 4, 10 * size)}[tier]
    store = ActivationStore(budgets[0], host_budget_bytes=budgets[1], disk_budget_bytes=budgets[2], disk_dir=tmp_path)
    store.put(record)
    # A later record takes the device tier: this one moves to host memory, and (with a disk tier) host memory,
    # now fuller than its write-back mark, writes it to disk.
    store.put(record_alone(model, adapter, prompt[:30], dtype=dtype, record_id="later"))
    store.flush()
    assert store.tier_of(record_id) == tier
    return store


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tier", ["host", "disk"])
def test_gradients_from_every_tier_equal_in_memory_gradients(model, adapter, sample_ids, tmp_path, tier, dtype):
    prompt, response = sample_ids
    sample = Sample(prompt.tolist(), response.tolist(), record_id="resp")
    in_memory = ActivationStore(1 << 30)
    in_memory.put(record_alone(model, adapter, prompt, dtype=dtype, record_id="resp"))
    expected, _ = gradients(model, adapter, in_memory, sample)
    store = record_down_to(tier, model, adapter, prompt, dtype, tmp_path)
    got, trainer = gradients(model, adapter, store, sample)
    assert trainer.stats.replayed == 1 and trainer.stats.layers_reloaded == model.config.num_layers
    for g, e in zip(got, expected, strict=True):
        assert torch.equal(g, e)  # the same bytes came back: exactly the same gradients
    if tier == "disk":
        assert store.stats.disk_reads >= model.config.num_layers


def flip_byte_of(path, tensor_name: str) -> None:
    """Flips a byte in the middle of one tensor's data in a safetensors file."""
    data = bytearray(path.read_bytes())
    (header_len,) = struct.unpack("<Q", data[:8])
    start, end = json.loads(data[8 : 8 + header_len])[tensor_name]["data_offsets"]
    data[8 + header_len + (start + end) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("when", ["before the step", "during the walk"])
def test_corrupt_disk_record_is_recomputed_never_trained_on(model, adapter, sample_ids, tmp_path, when):
    prompt, response = sample_ids
    sample = Sample(prompt.tolist(), response.tolist(), record_id="resp")
    expected, _ = gradients(model, adapter, None, sample)  # the recompute path's gradients
    store = record_down_to("disk", model, adapter, prompt, torch.float32, tmp_path)
    path = sorted(tmp_path.glob(f"*{disk.SUFFIX}"))[0]  # files are numbered in order of writing: "resp" went first
    # Read in the walk's thread (no prefetch), so that the walk reads layer 0 after the live forward is done.
    trainer = Trainer(model, copy.deepcopy(adapter), store, TrainerConfig(prefetch_depth=0))
    slices = trainer.backward_slices([sample], [1.0])
    if when == "during the walk":  # the walk began: the top layer's gradients are accumulated
        for _ in range(model.config.num_layers + 3):  # the live forward's layers, the loss, its backward, a layer
            # (in two slices: its MLP, then its attention and qkv)
            next(slices)
        assert trainer.adapter.A[f"{model.config.num_layers - 1}_qkv"].grad is not None
    flip_byte_of(path, "0.gate_up")
    ((loss, replayed),) = _run(slices)
    assert not replayed and loss > 0
    assert (trainer.stats.unreadable, trainer.stats.recomputed, trainer.stats.replayed) == (1, 1, 0)
    assert store.stats.corrupt == 1 and "resp" not in store and not path.exists()
    for p, e in zip(trainer.adapter.parameters(), expected, strict=True):
        assert torch.equal(p.grad, e)  # the partial replay's gradients were dropped, not mixed in


def _run(slices):
    while True:
        try:
            next(slices)
        except StopIteration as done:
            return done.value


def test_hedged_layers_are_recomputed_from_their_input(model, adapter, sample_ids, tmp_path):
    """A disk too slow for the walk: the plan recomputes layers from their recorded input; gradients stay those
    of the in-memory replay (fp32, unchanged adapter: equal up to rounding)."""
    prompt, response = sample_ids
    sample = Sample(prompt.tolist(), response.tolist(), record_id="resp")
    in_memory = ActivationStore(1 << 30)
    in_memory.put(record_alone(model, adapter, prompt, record_id="resp"))
    expected, _ = gradients(model, adapter, in_memory, sample)
    store = record_down_to("disk", model, adapter, prompt, torch.float32, tmp_path)
    trainer = Trainer(model, copy.deepcopy(adapter), store)
    trainer.costs = CostModel(read_bytes_per_s={"disk": 1e3}, walk_s_per_row=1e-3, recompute_s_per_row=1e-3)
    _run(trainer.backward_slices([sample], [1.0]))
    n = model.config.num_layers
    assert trainer.stats.replayed == 1 and trainer.stats.layers_recomputed == n
    assert trainer.stats.layers_reloaded == 0
    for p, e in zip(trainer.adapter.parameters(), expected, strict=True):
        assert ((p.grad - e).norm() / e.norm()).item() <= 1e-6
    # The plan learned from the step: the disk's read bandwidth was measured (the input reads).
    assert trainer.costs.read_bytes_per_s["disk"] > 1e3


def test_corrupt_record_in_a_group_recomputes_the_whole_group(model, adapter, sample_ids, tmp_path):
    """Two samples replayed together, one record on disk: its file goes bad during the walk, so neither sample's
    partial replay is kept; both are recomputed (together), and the other record is released."""
    prompt, response = sample_ids
    samples = [Sample(prompt.tolist(), response.tolist(), record_id="resp"),
               Sample(prompt[:30].tolist(), response.tolist(), record_id="later")]  # fmt: skip
    expected = Trainer(model, copy.deepcopy(adapter), None, TrainerConfig(group_size=2))
    _run(expected.backward_slices(samples, [0.5, 0.5]))
    store = record_down_to("disk", model, adapter, prompt, torch.float32, tmp_path)  # "later" stays in memory
    path = sorted(tmp_path.glob(f"*{disk.SUFFIX}"))[0]
    trainer = Trainer(model, copy.deepcopy(adapter), store, TrainerConfig(prefetch_depth=0, group_size=2))
    slices = trainer.backward_slices(samples, [0.5, 0.5])
    for _ in range(model.config.num_layers + 2):  # the live forward's layers, the loss, its backward, a layer
        next(slices)
    flip_byte_of(path, "0.gate_up")
    results = _run(slices)
    assert [replayed for _, replayed in results] == [False, False]
    assert (trainer.stats.unreadable, trainer.stats.recomputed, trainer.stats.replayed) == (1, 2, 0)
    for p, e in zip(trainer.adapter.parameters(), expected.adapter.parameters(), strict=True):
        assert torch.equal(p.grad, e.grad)
    assert store.evict("later")  # released: no pin left behind
