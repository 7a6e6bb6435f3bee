"""The in-memory activation store: budget, LRU, TTL, pins and counters."""

from __future__ import annotations

import threading

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from alchemist.activations.record import Record
from alchemist.activations.store import ActivationStore


def make_record(record_id: str, num_bytes: int, created_s: float | None = None) -> Record:
    layer = {"qkv": torch.zeros(num_bytes // 4, dtype=torch.float32)}
    kwargs = {} if created_s is None else {"created_s": created_s}
    return Record(record_id, (1, 2, 3), 0, [layer], **kwargs)


def test_lru_eviction_and_counters():
    store = ActivationStore(budget_bytes=1000)
    for i in range(3):
        assert store.put(make_record(f"r{i}", 400))
    # r0 was least recently used when r2 arrived: it went.
    assert "r0" not in store and "r1" in store and "r2" in store
    assert store.stats.evictions == 1 and store.stats.bytes_held == 800
    assert store.lookup("r1") is not None  # r1 is now most recent
    store.put(make_record("r3", 400))
    assert "r2" not in store and "r1" in store
    assert store.lookup("nope") is None
    assert (store.stats.hits, store.stats.misses) == (1, 1)


def test_pinned_records_are_not_evicted_and_oversized_rejected():
    store = ActivationStore(budget_bytes=1000)
    store.put(make_record("a", 600))
    assert store.pin("a")
    assert not store.put(make_record("b", 600))  # no room: "a" is pinned
    assert store.stats.rejected == 1 and "a" in store
    assert not store.evict("a")
    store.release("a")
    assert store.put(make_record("b", 600)) and "a" not in store
    assert not store.put(make_record("huge", 2000))


def test_ttl_expiry():
    store = ActivationStore(budget_bytes=10_000, ttl_s=60)
    store.put(make_record("old", 100, created_s=0.0))  # created at the epoch: long expired
    store.put(make_record("new", 100))
    assert store.lookup("old") is None and store.lookup("new") is not None
    assert store.stats.expirations == 1 and store.stats.bytes_held == 100


ops = st.lists(
    st.tuples(
        st.sampled_from(["put", "lookup", "pin", "release", "evict"]),
        st.integers(0, 7),
        st.integers(1, 700),
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(ops)
def test_budget_is_never_exceeded(sequence):
    store = ActivationStore(budget_bytes=1500)
    for op, key, size in sequence:
        rid = f"r{key}"
        if op == "put":
            store.put(make_record(rid, size * 4))
        elif op == "lookup":
            store.lookup(rid)
        elif op == "pin":
            store.pin(rid)
        elif op == "release":
            store.release(rid)
        else:
            store.evict(rid)
        assert store.stats.bytes_held <= store.budget_bytes
        assert store.stats.bytes_held == sum(r.nbytes for r in store._placement.entries.values())


def test_budget_holds_under_concurrent_puts():
    store = ActivationStore(budget_bytes=4000)
    seen_over = []

    def writer(offset: int) -> None:
        for i in range(200):
            store.put(make_record(f"{offset}-{i}", 400 + 4 * (i % 7)))
            store.pin(f"{offset}-{i - 3}")
            store.release(f"{offset}-{i - 5}")
            if store.stats.bytes_held > store.budget_bytes:
                seen_over.append(store.stats.bytes_held)

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not seen_over
    assert store.stats.bytes_held == sum(r.nbytes for r in store._placement.entries.values()) <= 4000
