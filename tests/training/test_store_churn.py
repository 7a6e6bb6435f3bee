"""Real training steps while the store churns: budgets hold, and every step trains on the exact record or none.

A trainer thread replays samples (tiny model, fp32 records) while the main thread puts records, evicts, corrupts
disk files and lets records move down the tiers, in a randomized order (hypothesis). Each sample's gradient must
be either exactly the in-memory replay's (the record came back intact, from whichever tier) or exactly the
recompute path's (the record was gone, stale or corrupt) — never a mix, never an exception — and no tier's
high-water mark may exceed its budget.
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from alchemist.activations import disk
from alchemist.activations.store import ActivationStore
from alchemist.model.loader import build_model
from alchemist.training.slices import run_to_end
from alchemist.training.trainer import Sample, Trainer
from tests.training.recording import record_alone
from tests.training.test_replay import lora_with_nonzero_b

NUM_RECORDS = 4


@pytest.fixture(scope="module")
def world(tiny_dirs):
    """The model, the adapter, per sample its record and both reference gradients (replayed, recomputed)."""
    model = build_model(tiny_dirs["llama-gqa-untied"], torch.float32)
    adapter = lora_with_nonzero_b(model)
    g = torch.Generator().manual_seed(11)
    cases = []
    for i in range(NUM_RECORDS):
        prompt = torch.randint(0, 256, (24 + 4 * i,), generator=g)
        response = torch.randint(0, 256, (6,), generator=g)
        record = record_alone(model, adapter, prompt, record_id=f"r{i}")
        sample = Sample(prompt.tolist(), response.tolist(), record_id=f"r{i}")
        in_memory = ActivationStore(1 << 30)
        in_memory.put(record)
        replayed, recomputed = grads_of(model, adapter, in_memory, sample), grads_of(model, adapter, None, sample)
        cases.append((record, sample, replayed, recomputed))
    return model, adapter, cases


def grads_of(model, adapter, store, sample) -> list[torch.Tensor]:
    trainer = Trainer(model, copy.deepcopy(adapter), store)
    run_to_end(trainer.backward_slices([sample], [1.0]))
    assert trainer.stats.replayed == (store is not None)
    return [p.grad.clone() for p in trainer.adapter.parameters()]


operations = st.lists(
    st.tuples(st.sampled_from(["put", "evict", "corrupt", "flush"]), st.integers(0, NUM_RECORDS - 1)),
    min_size=4,
    max_size=16,
)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(operations)
def test_training_under_store_churn_is_exact_and_within_budgets(world, tmp_path_factory, sequence):
    model, adapter, cases = world
    size = max(record.nbytes for record, *_ in cases)
    directory = tmp_path_factory.mktemp("records")
    store = ActivationStore(
        size + size // 2, host_budget_bytes=size + size // 4, disk_budget_bytes=3 * size, disk_dir=directory
    )
    for record, *_ in cases:  # all put first: they spread over the tiers
        store.put(record)
    store.flush()
    outcomes: list[str] = []
    errors: list[BaseException] = []
    stop = threading.Event()
    stepped = threading.Semaphore(0)  # released after every training step

    def train() -> None:
        step = 0
        while not stop.is_set() or step < NUM_RECORDS:
            _, sample, replayed, recomputed = cases[step % NUM_RECORDS]
            trainer = Trainer(model, copy.deepcopy(adapter), store)
            try:
                run_to_end(trainer.backward_slices([sample], [1.0]))
            except BaseException as e:  # noqa: BLE001 (any exception is a failure, reported below)
                errors.append(e)
                return
            grads = [p.grad for p in trainer.adapter.parameters()]
            if trainer.stats.replayed and all(torch.equal(a, b) for a, b in zip(grads, replayed, strict=True)):
                outcomes.append("replayed")
            elif trainer.stats.recomputed and all(torch.equal(a, b) for a, b in zip(grads, recomputed, strict=True)):
                outcomes.append("recomputed")
            else:
                outcomes.append(f"wrong gradient for {sample.record_id} (replayed={trainer.stats.replayed})")
            step += 1
            stepped.release()

    thread = threading.Thread(target=train)
    thread.start()
    try:
        for op, i in sequence:
            record = cases[i][0]
            if op == "put":
                store.put(record)
            elif op == "evict":
                store.evict(record.record_id)
            elif op == "flush":
                store.flush()
            else:  # damage the newest finished file, if any (a record on disk, or one just evicted)
                files = sorted(directory.glob(f"*{disk.SUFFIX}"))
                if files:
                    _flip_last_byte(files[-1])
            stepped.acquire(timeout=10)  # the next operation lands during the next training step
    finally:
        stop.set()
        thread.join()
        store.flush()
    assert not errors, errors
    assert all(o in ("replayed", "recomputed") for o in outcomes), outcomes
    assert len(outcomes) >= len(sequence)
    for tier, budget in store.budgets.items():
        assert store.stats.max_tier_bytes[tier] <= budget, (tier, store.stats.max_tier_bytes)
    store.close()


def _flip_last_byte(path) -> None:
    """The data ends the file: its last byte belongs to some layer's tensor."""
    try:
        with open(path, "r+b") as f:
            f.seek(-1, 2)
            byte = f.read(1)
            f.seek(-1, 2)
            f.write(bytes([byte[0] ^ 0xFF]))
    except (FileNotFoundError, OSError):
        pass  # evicted meanwhile: its file is gone
