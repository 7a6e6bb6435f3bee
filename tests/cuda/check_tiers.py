"""CUDA check of the activation store's tiers (run on a GPU machine; not part of CI, which has no GPU):

    python -m tests.cuda.check_tiers

Records made on the GPU go device -> pinned host -> disk and read back bit-exactly, on the GPU.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from alchemist.activations.store import ActivationStore
from tests.activations.test_tiered_store import assert_reads_exact, make_record


def check_round_trip(tmp_path: Path, dtype: torch.dtype) -> None:
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
    host_layer = store._placement.entries["b"].record.layers[0]
    assert all(t.is_pinned() and not t.is_cuda for t in host_layer.values())
    for record in on_gpu:
        assert all(t.is_cuda for t in store.get_layer(record.record_id, 0).values())
        assert_reads_exact(store, record)
    store.close()


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("this check needs CUDA")
    for dtype in (torch.bfloat16, torch.float32):
        with tempfile.TemporaryDirectory() as tmp:
            check_round_trip(Path(tmp), dtype)
        print(f"tiers round trip on CUDA, {dtype}: ok")


if __name__ == "__main__":
    main()
