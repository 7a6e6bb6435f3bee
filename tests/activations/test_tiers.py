"""Copies between the memory tiers: none on CPU (the tiers share process memory); pinned copies on side streams on
CUDA, bit-exact and on the device the record came from."""

from __future__ import annotations

import pytest
import torch

from alchemist.activations.store import ActivationStore
from alchemist.activations.tiers import TierCopies
from tests.activations.test_tiered_store import assert_reads_exact, make_record


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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_round_trip_through_pinned_host_and_disk(tmp_path, dtype):
    records = [make_record(r, i, dtype=dtype) for i, r in enumerate("abc")]
    on_gpu = []
    for record in records:
        layers = [{n: t.cuda() for n, t in layer.items()} for layer in record.layers]
        on_gpu.append(type(record)(record.record_id, record.prompt_ids, 0, layers))
    n = records[0].nbytes
    store = ActivationStore(n, host_budget_bytes=2 * n, disk_budget_bytes=4 * n, disk_dir=tmp_path)
    for record in on_gpu:
        store.put(record)
        store.flush()
    assert [store.tier_of(r) for r in "abc"] == ["disk", "host", "device"]
    host_layer = store._records["b"].record.layers[0]
    assert all(t.is_pinned() and not t.is_cuda for t in host_layer.values())
    for record in on_gpu:
        assert all(t.is_cuda for t in store.get_layer(record.record_id, 0).values())
        assert_reads_exact(store, record)
    store.close()
