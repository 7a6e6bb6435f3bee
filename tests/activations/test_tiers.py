"""Copies between the memory tiers: none on CPU (the tiers share process memory). The CUDA side (pinned copies on
side streams) is checked on a GPU machine by ``tests/cuda/check_tiers.py``, outside CI."""

from __future__ import annotations

import torch

from alchemist.activations.store import ActivationStore
from alchemist.activations.tiers import TierCopies
from tests.activations.test_tiered_store import make_record


def test_cpu_tiers_hand_tensors_over_without_copies():
    copies = TierCopies()
    layers = make_record("a", 0).layers
    cpu = torch.device("cpu")
    assert copies.mark(cpu) is None
    host, ready = copies.to_host(layers, cpu, None)
    assert host is layers and ready is None
    assert copies.to_device(layers[1], cpu, None) is layers[1]


def test_memory_tiers_return_the_stored_tensors_and_disk_fresh_ones(tmp_path):
    a, b = make_record("a", 0), make_record("b", 1)
    store = ActivationStore(a.nbytes, host_budget_bytes=a.nbytes, disk_budget_bytes=4 * a.nbytes, disk_dir=tmp_path)
    store.put(a)
    assert store.get_layer("a", 0)["qkv"] is a.layers[0]["qkv"]  # device: a view, no copy
    store.put(b)
    assert store.tier_of("a") in ("host", "disk")  # the host is full: a is being written
    store.flush()
    assert store.get_layer("b", 0)["qkv"] is b.layers[0]["qkv"]
    assert store.tier_of("a") == "disk"
    got = store.get_layer("a", 0)["qkv"]
    assert got is not a.layers[0]["qkv"] and torch.equal(got, a.layers[0]["qkv"])
    store.close()
