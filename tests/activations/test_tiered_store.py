"""The activation store's tiers: device -> host -> disk -> evicted, by priority and TTL, within every budget.

Bit-exact round trips through each tier, demotion order, TTL across tiers, the disk files' life cycle, damaged files
(a specific exception and a counter, never wrong values), and a property test with a concurrent training-like reader
and the background disk writer.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from alchemist.activations import disk
from alchemist.activations.placement import TIERS
from alchemist.activations.record import RecordBuilder, record_widths
from alchemist.activations.store import ActivationStore, RecordCorruptError, RecordUnavailable
from alchemist.config import EngineConfig, RecordConfig
from alchemist.engine import LLMEngine
from alchemist.engine.sequence import SamplingParams
from alchemist.model.config import ModelConfig
from alchemist.model.loader import build_model
from tests.engine.helpers import char_tokenizer

# SmolLM2-135M's widths, three of its 30 layers.
SMOLLM2 = ModelConfig(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=3, num_heads=9, num_kv_heads=3, head_dim=64
)
TINY = ModelConfig(
    vocab_size=32, hidden_size=4, intermediate_size=3, num_layers=3, num_heads=2, num_kv_heads=1, head_dim=2
)


def make_record(
    record_id: str,
    seed: int = 0,
    num_tokens: int = 3,
    dtype: torch.dtype = torch.bfloat16,
    config: ModelConfig = SMOLLM2,
    requested: bool = False,
    created_s: float | None = None,
):
    """A record of every RECORDED tensor (lse in fp32), random bits from ``seed``; ``adapter_version`` = seed."""
    builder = RecordBuilder(record_id, list(range(num_tokens)), seed, config, dtype, requested=requested)
    g = torch.Generator().manual_seed(seed)
    widths = record_widths(config)
    for layer in range(config.num_layers):
        for name, width in widths.items():
            builder.write(layer, name, 0, torch.randn(num_tokens, width, generator=g))
    builder.finish_chunk(0, num_tokens)
    record = builder.build()
    if created_s is not None:
        record.created_s = created_s
    return record


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def assert_reads_exact(store: ActivationStore, record) -> None:
    """Every layer, in backward order like the trainer's walk, equal bit for bit to what was put."""
    for i in reversed(range(len(record.layers))):
        got = store.get_layer(record.record_id, i)
        assert set(got) == set(record.layers[i])
        for name, want in record.layers[i].items():
            assert same_bits(got[name], want), (record.record_id, i, name)


def record_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if p.name.endswith(disk.SUFFIX))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_tensor_round_trips_through_every_tier(tmp_path, dtype):
    a, b, c = (make_record(rid, seed, dtype=dtype) for seed, rid in enumerate("abc"))
    n = a.nbytes
    store = ActivationStore(n, host_budget_bytes=2 * n, disk_budget_bytes=4 * n, disk_dir=tmp_path)
    assert store.put(a) and store.tier_of("a") == "device"
    assert_reads_exact(store, a)
    assert store.put(b)
    store.flush()
    assert store.tier_of("a") == "host"  # half the host budget: below the write-back mark
    assert_reads_exact(store, a)
    assert store.put(c)  # b joins a in host, which is now full: its lowest priority, a, goes to disk
    store.flush()
    assert [store.tier_of(r) for r in "abc"] == ["disk", "host", "device"]
    for record in (a, b, c):
        assert_reads_exact(store, record)
        part = store.get_layer(record.record_id, 1, names=("h", "lse"))  # only these are read
        assert list(part) == ["h", "lse"] and all(same_bits(part[k], record.layers[1][k]) for k in part)
    s = store.stats
    assert s.disk_writes == 1 and s.disk_reads == len(a.layers) + 1 and s.demotions == 3 and s.evictions == 0
    assert s.tier_records == {"device": 1, "host": 1, "disk": 1}
    assert s.tier_bytes["disk"] == record_files(tmp_path)[0].stat().st_size
    assert s.bytes_held == 2 * n + s.tier_bytes["disk"]
    on_disk = store.lookup("a")  # shapes and dtypes without values
    assert on_disk.prompt_ids == a.prompt_ids and on_disk.dtype == dtype and on_disk.nbytes == a.nbytes
    assert all(t.is_meta for layer in on_disk.layers for t in layer.values())
    store.close()
    assert record_files(tmp_path) == []


def test_requested_records_are_kept_over_newer_ones():
    q, x, y, z = (make_record(r, i, config=TINY, requested=r == "q") for i, r in enumerate("qxyz"))
    n = q.nbytes
    store = ActivationStore(2 * n, host_budget_bytes=n)
    for record in (q, x, y):
        assert store.put(record)
    assert [store.tier_of(r) for r in "qxy"] == ["device", "host", "device"]  # x, not the older q, moved down
    assert store.put(z)  # y moves down, x (lowest in host) is evicted
    assert [store.tier_of(r) for r in "qxyz"] == ["device", None, "host", "device"]
    assert store.stats.demotions == 2 and store.stats.evictions == 1

    # Nothing ranks below a requested record: an ordinary one is refused rather than evict it.
    store = ActivationStore(n)
    assert store.put(q) and not store.put(x)
    assert store.stats.rejected == 1 and "q" in store


def test_lru_priority_ignores_the_request_flag():
    q, x, y, z = (make_record(r, i, config=TINY, requested=r == "q") for i, r in enumerate("qxyz"))
    n = q.nbytes
    store = ActivationStore(2 * n, host_budget_bytes=n, evict_priority="lru")
    for record in (q, x, y):
        store.put(record)
    assert [store.tier_of(r) for r in "qxy"] == ["host", "device", "device"]
    assert store.lookup("x") is not None  # x is now more recent than y
    store.put(z)
    assert [store.tier_of(r) for r in "qxyz"] == [None, "device", "host", "device"]


def test_pinned_records_never_move():
    a, b, c = (make_record(r, i, config=TINY) for i, r in enumerate("abc"))
    n = a.nbytes
    store = ActivationStore(2 * n, host_budget_bytes=n)
    store.put(a)
    assert store.pin("a")
    store.put(b)
    store.put(c)  # b, not the older but pinned a, moved down
    assert [store.tier_of(r) for r in "abc"] == ["device", "host", "device"]
    assert store.put(make_record("d", 3, config=TINY))  # c moves down, b is evicted; a stays
    assert [store.tier_of(r) for r in "abcd"] == ["device", None, "host", "device"]
    assert not store.evict("a")
    store.release("a")
    assert store.put(make_record("e", 4, config=TINY))  # now a, the least recent of all, goes
    assert [store.tier_of(r) for r in "acde"] == [None, "host", "device", "device"]


def test_ttl_expires_records_in_every_tier(tmp_path):
    now = [1000.0]
    a, b, c = (make_record(r, i, config=TINY, created_s=now[0]) for i, r in enumerate("abc"))
    n = a.nbytes
    store = ActivationStore(
        n, ttl_s=60, host_budget_bytes=2 * n, disk_budget_bytes=8 * n + 10_000, disk_dir=tmp_path, clock=lambda: now[0]
    )
    for record in (a, b, c):
        store.put(record)
        store.flush()
    assert [store.tier_of(r) for r in "abc"] == ["disk", "host", "device"]
    store.pin("b")
    now[0] += 61
    assert store.lookup("a") is None and store.lookup("c") is None
    assert store.lookup("b") is not None  # pinned: it stays until released
    assert store.stats.expirations == 2 and record_files(tmp_path) == []
    store.release("b")
    assert store.lookup("b") is None and store.stats.bytes_held == 0
    assert store.stats.tier_bytes == dict.fromkeys(TIERS, 0)


def test_disk_files_follow_their_records_and_stale_ones_are_cleaned(tmp_path):
    stale = [tmp_path / f"000000000000{disk.SUFFIX}", tmp_path / f"000000000007{disk.SUFFIX}.tmp"]
    for path in stale:
        path.write_bytes(b"an earlier run's file")
    (tmp_path / "keep.txt").write_text("not ours")
    records = [make_record(f"r{i}", i, config=TINY) for i in range(6)]
    n = records[0].nbytes
    file_bytes = disk.file_bytes_bound(records[0].layers)
    store = ActivationStore(n, disk_budget_bytes=3 * file_bytes, disk_dir=tmp_path)  # no host tier: device -> disk
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt"]
    for record in records:
        store.put(record)
        store.flush()
    # The device's record is written as soon as the device is 3/4 full; the disk keeps the most recent ones.
    on_disk = [r.record_id for r in records if store.tier_of(r.record_id) == "disk"]
    assert store.tier_of("r5") == "disk" and on_disk == [f"r{i}" for i in range(6 - len(on_disk), 6)]
    assert 2 <= len(on_disk) < 6 and store.stats.evictions == 6 - len(on_disk)
    assert len(record_files(tmp_path)) == len(on_disk) == store.stats.tier_records["disk"]
    assert sum(p.stat().st_size for p in record_files(tmp_path)) == store.stats.tier_bytes["disk"]
    assert store.evict("r4") and len(record_files(tmp_path)) == len(on_disk) - 1
    store.put(make_record("r5", 9, config=TINY))  # a new record under an old id replaces the old one's file
    store.flush()
    assert len(record_files(tmp_path)) == len(on_disk) - 1 and store.tier_of("r5") == "disk"
    assert_reads_exact(store, make_record("r5", 9, config=TINY))
    store.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt"]


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_damaged_disk_record_raises_counts_and_is_dropped(tmp_path, damage):
    a, b = make_record("a", 0), make_record("b", 1)
    n = a.nbytes
    store = ActivationStore(n, disk_budget_bytes=4 * n, disk_dir=tmp_path)
    for record in (a, b):
        store.put(record)
        store.flush()
    assert store.tier_of("a") == "disk" and store.tier_of("b") == "disk"
    path = record_files(tmp_path)[0]
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        del data[len(data) // 2 :]
    else:
        data[-100] ^= 0x01  # in the last tensor's bytes
    path.write_bytes(data)
    assert store.pin("a")
    with pytest.raises(RecordCorruptError) as err:
        assert_reads_exact(store, a)
    assert isinstance(err.value, RecordUnavailable) and isinstance(err.value, KeyError)
    assert store.stats.corrupt == 1 and "a" not in store and not path.exists()
    with pytest.raises(RecordUnavailable):
        store.get_layer("a", 0)
    assert_reads_exact(store, b)  # the store keeps working
    assert store.put(make_record("c", 2)) and store.stats.corrupt == 1
    store.flush()
    # A new record under the id: the late release of the dropped one's pin does not take the new one's.
    assert store.put(make_record("a", 3)) and store.pin("a")
    store.release("a")  # the dropped record's
    assert not store.evict("a")
    store.release("a")
    assert store.evict("a")
    store.close()


def test_a_record_stays_readable_until_its_file_is_complete(tmp_path, monkeypatch):
    """A write in flight: its bytes are reserved on disk, the record is read from host; pinned meanwhile, it stays."""
    gate = threading.Event()
    real_write = disk.write_record

    def slow_write(path, layers):
        gate.wait(10)
        return real_write(path, layers)

    monkeypatch.setattr(disk, "write_record", slow_write)
    a, b = make_record("a", 0, config=TINY), make_record("b", 1, config=TINY)
    n = a.nbytes
    store = ActivationStore(n, host_budget_bytes=n, disk_budget_bytes=10_000, disk_dir=tmp_path)
    store.put(a)
    store.put(b)  # a moves to host, which is full: its write to disk starts
    assert store.tier_of("a") == "host" and store.stats.tier_bytes["disk"] >= disk.file_bytes_bound(a.layers)
    assert_reads_exact(store, a)
    store.pin("a")  # being trained on when the write ends: the file is thrown away
    gate.set()
    store.flush()
    assert store.tier_of("a") == "host" and store.stats.disk_writes == 0 and record_files(tmp_path) == []
    assert store.stats.tier_bytes["disk"] == 0
    store.release("a")  # written now
    store.flush()
    assert store.tier_of("a") == "disk" and store.stats.disk_writes == 1
    assert_reads_exact(store, a)
    store.close()


def test_a_failed_write_keeps_the_record_where_it_is(tmp_path, monkeypatch):
    def failing_write(path, layers):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(disk, "write_record", failing_write)
    a, b = make_record("a", 0, config=TINY), make_record("b", 1, config=TINY)
    store = ActivationStore(a.nbytes, host_budget_bytes=a.nbytes, disk_budget_bytes=10_000, disk_dir=tmp_path)
    store.put(a)
    store.put(b)
    store.flush()  # returns: the failed write is not retried forever
    assert store.tier_of("a") == "host" and store.stats.disk_write_errors == 1
    assert store.stats.tier_bytes["disk"] == 0 and list(tmp_path.iterdir()) == []
    assert_reads_exact(store, a)
    store.close()


def test_engine_records_the_request_flag_and_spills_to_disk(tiny_dirs, tmp_path):
    model = build_model(tiny_dirs["llama-gqa-untied"], torch.float32)
    prompts = {f"req-{i}": list(range(10 + i, 30 + i)) for i in range(3)}
    one = make_record("x", num_tokens=20, dtype=torch.float32, config=model.config).nbytes
    record_config = RecordConfig(
        policy="all", dtype="float32", store_budget_bytes=one, host_budget_bytes=0, disk_budget_bytes=10 * one
    )
    engine = LLMEngine(model, char_tokenizer(5), EngineConfig(max_num_seqs=1, max_model_len=64), record_config)
    assert engine.store.disk_dir is not None
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, SamplingParams(max_tokens=2, ignore_eos=True, record=rid == "req-1"))
        while engine.has_unfinished():
            engine.step()
        engine.store.flush()
    assert [engine.store.tier_of(rid) for rid in prompts] == ["disk", "disk", "disk"]
    assert [engine.store.lookup(rid).requested for rid in prompts] == [False, True, False]
    assert engine.store.get_layer("req-1", 1)["h"].shape == (20, model.config.hidden_size)
    stats = engine.stats()
    assert stats.activation_tier_bytes["disk"] == engine.store.stats.tier_bytes["disk"] > 0
    assert stats.activation_bytes == engine.store.stats.bytes_held
    engine.store.close()


# --- the property test -------------------------------------------------------------------------------------------

NUM_KEYS = 8
PROPERTY = ModelConfig(
    vocab_size=32, hidden_size=2, intermediate_size=1, num_layers=3, num_heads=1, num_kv_heads=1, head_dim=2
)


def property_record(record_id: str, serial: int, num_tokens: int, requested: bool, now: float):
    dtype = torch.bfloat16 if serial % 2 else torch.float32
    return make_record(record_id, serial, num_tokens, dtype, PROPERTY, requested, created_s=now)


def read_check(store: ActivationStore, record_id: str, pinned: bool, corrupt: int = 0) -> str | None:
    """Reads the record's layers in backward order; an error message if a read is wrong. A pinned record may
    vanish only if a damaged file was found (``stats.corrupt`` above ``corrupt``, its value before the pin)."""
    record = store.lookup(record_id)
    if record is None:
        return "pinned record vanished before its read" if pinned and store.stats.corrupt == corrupt else None
    want = property_record(record_id, record.adapter_version, record.num_tokens, record.requested, 0.0)
    for i in reversed(range(len(want.layers))):
        try:
            got = store.get_layer(record_id, i)
        except RecordCorruptError:
            return None
        except RecordUnavailable:
            return "pinned record vanished mid-read" if pinned and store.stats.corrupt == corrupt else None
        if set(got) != set(want.layers[i]) or not all(same_bits(got[k], v) for k, v in want.layers[i].items()):
            if not pinned and store.lookup(record_id) is not record:  # replaced between our reads
                return None
            if pinned and store.stats.corrupt != corrupt:  # dropped (damaged) despite the pin, the id reused
                return None
            return f"{record_id} layer {i}: wrong values"
    return None


def training_reader(store: ActivationStore, stop: threading.Event, errors: list[str]) -> None:
    """Like a training step: pin a record, read its layers in backward order, release it."""
    while not stop.is_set():
        for key in range(NUM_KEYS):
            record_id, corrupt = f"r{key}", store.stats.corrupt
            if store.pin(record_id):
                try:
                    if (error := read_check(store, record_id, pinned=True, corrupt=corrupt)) is not None:
                        errors.append(error)
                finally:
                    store.release(record_id)
        time.sleep(0.0005)


def check_accounting(store: ActivationStore, directory: Path, settled: bool) -> None:
    with store._lock:
        s, entries = store.stats, list(store._placement.entries.values())
        for tier in TIERS:
            assert s.tier_bytes[tier] <= store.budgets[tier]
            assert s.tier_records[tier] == sum(e.tier == tier for e in entries)
        assert s.bytes_held == sum(e.nbytes for e in entries) and s.records == len(entries)
        if settled:  # no write in flight: the tiers hold exactly their records, the directory exactly their files
            for tier in TIERS:
                assert s.tier_bytes[tier] == sum(e.nbytes for e in entries if e.tier == tier)
            assert record_files(directory) == sorted(e.path for e in entries if e.tier == "disk")
            assert all(e.nbytes == e.path.stat().st_size for e in entries if e.tier == "disk")


def corrupt_one(store: ActivationStore, key: int, size: int) -> str | None:
    """Flips a byte in the data of a disk record's file; the record's id (None if no record is on disk). Under the
    store's lock: the training reader may drop a record (deleting its file) at any moment otherwise."""
    with store._lock:
        store._placement.expire(store._clock())  # what is left is not dropped by the next lookup
        on_disk = [e for e in store._placement.entries.values() if e.tier == "disk"]
        if not on_disk:
            return None
        entry = on_disk[key % len(on_disk)]
        record = entry.record
        data_bytes = property_record("r", record.adapter_version, record.num_tokens, False, 0.0).nbytes
        with open(entry.path, "r+b") as f:  # the tensors' bytes end the file
            f.seek(-1 - (size * 7919) % data_bytes, os.SEEK_END)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x40]))
    return record.record_id


OPS = ["put"] * 4 + ["put_requested"] * 2 + ["read", "pin", "release", "evict", "advance"] + ["corrupt", "flush"] * 2
operations = st.lists(
    st.tuples(st.sampled_from(OPS), st.integers(0, NUM_KEYS - 1), st.integers(1, 6)), min_size=10, max_size=50
)


@settings(max_examples=60, deadline=None)
@given(operations, st.sampled_from(["requested", "lru"]))
def test_budgets_hold_and_reads_are_exact_under_concurrency(sequence, priority):
    record_bytes = property_record("r", 0, 6, False, 0.0).nbytes  # the largest, in fp32
    file_bytes = disk.file_bytes_bound(property_record("r", 0, 6, False, 0.0).layers)
    with tempfile.TemporaryDirectory() as d:
        directory, now, errors = Path(d), [1000.0], []
        store = ActivationStore(
            3 * record_bytes // 2,
            ttl_s=100,
            host_budget_bytes=3 * record_bytes // 2,
            disk_budget_bytes=3 * file_bytes,
            disk_dir=directory,
            evict_priority=priority,
            clock=lambda: now[0],
        )
        pinned: dict[str, object] = {}  # pinned by this thread: id -> the record it had then
        stop = threading.Event()
        reader = threading.Thread(target=training_reader, args=(store, stop, errors))
        reader.start()
        try:
            for serial, (op, key, size) in enumerate(sequence, start=1):
                record_id = f"r{key}"
                if op.startswith("put"):
                    accepted = store.put(property_record(record_id, serial, size, op == "put_requested", now[0]))
                    assert not (accepted and record_id in pinned)  # a pinned record is never replaced
                elif op == "read":
                    if (error := read_check(store, record_id, pinned=False)) is not None:
                        errors.append(error)
                elif op == "pin" and record_id not in pinned and store.pin(record_id):
                    pinned[record_id] = store.lookup(record_id)
                elif op == "release" and record_id in pinned:
                    del pinned[record_id]
                    store.release(record_id)
                elif op == "evict":
                    assert not (store.evict(record_id) and record_id in pinned)
                elif op == "advance":
                    now[0] += 20 * size
                elif op == "corrupt":
                    before = (store.stats.corrupt, store.stats.evictions, store.stats.expirations)
                    if (damaged := corrupt_one(store, key, size)) is not None:
                        assert read_check(store, damaged, pinned=False) is None  # raised, or the reader's did
                        # Found damaged, unless evicted first (a disk write after a release of the reader's) or
                        # expired first (past its TTL while the reader had it pinned).
                        s = store.stats
                        assert damaged not in store
                        assert s.corrupt == before[0] + 1 or (s.evictions, s.expirations) > before[1:]
                        pinned.pop(damaged, None)  # dropped, pinned or not: never trained on
                elif op == "flush":
                    store.flush()
                for held_id, held in pinned.items():  # pinned records never move, vanish or change
                    assert store.lookup(held_id) is held
                    assert read_check(store, held_id, pinned=True) is None
                check_accounting(store, directory, settled=False)
        finally:
            stop.set()
            reader.join()
        for held_id in pinned:
            store.release(held_id)
        store.flush()
        check_accounting(store, directory, settled=True)
        assert not errors, errors
        for tier in TIERS:
            assert store.stats.max_tier_bytes[tier] <= store.budgets[tier]
        store.close()
        assert record_files(directory) == []
