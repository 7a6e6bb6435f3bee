"""The feedback log on real SQLite files: durable appends (across processes, through SIGKILL), idempotency,
reads by position, counts and listeners."""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from alchemist.feedback.log import FeedbackEntry, FeedbackLog
from alchemist.feedback.schema import VERSION

REPO_ROOT = Path(__file__).resolve().parents[2]


def submission(response_id: str = "chatcmpl-1", **overrides) -> dict:
    fields = dict(
        response_id=response_id,
        kind="sft",
        rating=1,
        prompt_token_ids=[1, 2, 3],
        response_token_ids=[4, 5, 2],
        output_token_ids=[4, 5, 2],
        adapter_version=3,
        recorded=True,
    )
    return fields | overrides


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60
    )


@pytest.fixture
def log(tmp_path: Path):
    log = FeedbackLog(tmp_path / "data" / "feedback.sqlite")  # the directory does not exist yet
    yield log
    log.close()


def test_wal_mode_and_full_sync(log: FeedbackLog):
    log.append(**submission())
    assert log.path.with_name(log.path.name + "-wal").exists()
    with sqlite3.connect(log.path) as other:  # WAL is a property of the file, seen by every connection
        assert other.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert log._conn.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL: fsync on every commit


def test_append_then_read_back(log: FeedbackLog):
    assert log.last_seq() == 0 and log.read() == []
    first, created = log.append(**submission(correction="Better.", response_token_ids=[7, 8, 2]))
    assert created and first.seq == 1
    second, _ = log.append(**submission("chatcmpl-2", kind="negative", rating=-1, recorded=False))
    pref, _ = log.append(
        **submission("chatcmpl-3", kind="preference", rating=None, preferred_over="chatcmpl-4", rejected_token_ids=[9])
    )
    assert [e.seq for e in log.read()] == [1, 2, 3] and log.last_seq() == 3
    assert log.read(after_seq=1, limit=1) == [second]
    assert log.read(after_seq=3) == []
    entry = log.read()[0]
    assert entry == first
    assert (entry.response_id, entry.kind, entry.rating, entry.correction) == ("chatcmpl-1", "sft", 1, "Better.")
    assert (entry.prompt_token_ids, entry.response_token_ids, entry.output_token_ids) == (
        [1, 2, 3],
        [7, 8, 2],
        [4, 5, 2],
    )
    assert (entry.adapter_version, entry.recorded, entry.preferred_over, entry.rejected_token_ids) == (
        3,
        True,
        None,
        None,
    )
    assert (pref.preferred_over, pref.rejected_token_ids, pref.rating) == ("chatcmpl-4", [9], None)
    assert second.recorded is False and second.rating == -1


def test_large_token_ids_round_trip(log: FeedbackLog):
    ids = list(range(0, 2**31 - 1, 2**24)) + [2**31 - 1]
    entry, _ = log.append(**submission(prompt_token_ids=ids))
    assert log.read()[0].prompt_token_ids == ids == entry.prompt_token_ids


def test_the_same_submission_is_written_once(log: FeedbackLog):
    first, created = log.append(**submission())
    again, created_again = log.append(**submission(adapter_version=9))  # same user input, later state: same entry
    assert created and not created_again
    assert again == first and log.last_seq() == 1
    other, created_other = log.append(**submission(rating=-1, kind="negative"))  # a different submission
    assert created_other and other.seq == 2
    assert log.find(first.idempotency_key) == first and log.find("nope") is None


def test_counts_by_kind(log: FeedbackLog):
    assert log.counts() == {"sft": 0, "negative": 0, "preference": 0}
    log.append(**submission("a"))
    log.append(**submission("b", correction="x"))
    log.append(**submission("c", kind="negative", rating=-1))
    log.append(**submission("c", kind="negative", rating=-1))  # a repeat
    assert log.counts() == {"sft": 2, "negative": 1, "preference": 0}


def test_listeners_hear_each_new_entry_once(log: FeedbackLog):
    heard: list[FeedbackEntry] = []
    log.add_listener(heard.append)
    log.add_listener(lambda entry: 1 / 0)  # a failing listener: logged, the append still succeeds
    first, _ = log.append(**submission("a"))
    log.append(**submission("a"))
    second, _ = log.append(**submission("b"))
    assert heard == [first, second]


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"kind": "dpo"}, "kind"),
        ({"rating": 0}, "rating"),
        ({"rating": True}, "rating"),
        ({"kind": "preference"}, "rejected_token_ids"),  # a preference needs the worse output
        ({"rejected_token_ids": [1]}, "rejected_token_ids"),  # ... and only a preference has one
    ],
)
def test_bad_entries_are_refused_and_nothing_is_written(log: FeedbackLog, overrides: dict, field: str):
    with pytest.raises(ValueError, match=field):
        log.append(**submission(**overrides))
    assert log.last_seq() == 0


def test_concurrent_appends_get_distinct_consecutive_seqs(log: FeedbackLog):
    def append_many(thread: int) -> None:
        for i in range(20):
            log.append(**submission(f"r-{thread}-{i}"))

    threads = [threading.Thread(target=append_many, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [e.seq for e in log.read(limit=1000)] == list(range(1, 81))


def test_a_fresh_process_reads_what_another_wrote(log: FeedbackLog):
    entry, _ = log.append(**submission(correction="Fixed."))
    result = run_python(f"""
        import json
        from alchemist.feedback.log import FeedbackLog
        log = FeedbackLog({str(log.path)!r})
        print(json.dumps([e.__dict__ for e in log.read()]))
        log.append(response_id="from-child", kind="negative", rating=-1, prompt_token_ids=[1],
                   response_token_ids=[2], output_token_ids=[2], adapter_version=0, recorded=False)
    """)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == [entry.__dict__]
    assert [e.response_id for e in log.read()] == ["chatcmpl-1", "from-child"]  # and the other way round


def test_an_append_survives_sigkill_right_after_it_returns(tmp_path: Path):
    path = tmp_path / "feedback.sqlite"
    result = run_python(f"""
        import os, signal
        from alchemist.feedback.log import FeedbackLog
        log = FeedbackLog({str(path)!r})
        entry, created = log.append(response_id="killed", kind="sft", rating=1, prompt_token_ids=[1, 2],
                                    response_token_ids=[3, 2], output_token_ids=[3, 2], adapter_version=1,
                                    recorded=True)
        assert created
        os.kill(os.getpid(), signal.SIGKILL)  # no close, no checkpoint, no atexit
    """)
    assert result.returncode == -signal.SIGKILL, result.stderr
    log = FeedbackLog(path)
    try:
        [entry] = log.read()
        assert (entry.seq, entry.response_id, entry.response_token_ids) == (1, "killed", [3, 2])
    finally:
        log.close()


def test_comment_metadata_and_a_client_id_are_kept(log: FeedbackLog):
    meta = {"source": "langfuse", "trace": {"id": "t-1", "tags": ["a", "b"]}, "score": 0.5}
    entry, created = log.append(**submission(comment="Too long.", metadata=meta, feedback_id="client-7"))
    assert created and (entry.comment, entry.metadata, entry.feedback_id) == ("Too long.", meta, "client-7")
    assert log.read() == [entry] and log.get(entry.seq) == entry and log.get(99) is None
    assert log.find_feedback_id("client-7") == entry and log.find_feedback_id("client-8") is None
    # The client's id is the key: a retry under it finds the entry, whatever else the log would hash.
    again, created_again = log.append(**submission(comment="Too long.", metadata=meta, feedback_id="client-7"))
    assert not created_again and again == entry
    # Without an id, the same rating with another comment is other feedback; with neither, the old key.
    other, created_other = log.append(**submission(comment="Fine."))
    plain, created_plain = log.append(**submission())
    assert created_other and created_plain and len({entry.seq, other.seq, plain.seq}) == 3
    with pytest.raises(ValueError, match="metadata"):
        log.append(**submission("x", metadata=["not", "an", "object"]))


def test_states_settle_once_with_their_version_or_reason(log: FeedbackLog):
    seqs = [log.append(**submission(f"r{i}"))[0].seq for i in range(4)]
    assert {e.state for e in log.read()} == {"queued"} and log.queued_seqs() == [(s, "sft") for s in seqs]
    assert log.mark_trained(seqs[:2], 7) == 2
    assert log.mark_skipped(seqs[1:3], "too old") == 1  # seqs[1] is trained already: it stays so
    assert log.mark_trained(seqs[:1], 9) == 0
    with pytest.raises(ValueError, match="reason"):
        log.mark_skipped(seqs[3:], "")
    states = [(e.state, e.trained_version, e.skip_reason) for e in log.read()]
    assert states == [("trained", 7, None), ("trained", 7, None), ("skipped", None, "too old"), ("queued", None, None)]
    assert all((e.settled_s is None) == (e.state == "queued") for e in log.read())
    assert log.queued_seqs() == [(seqs[3], "sft")] and log.queued_seqs(through_seq=seqs[2]) == []


def test_trained_corrections_leave_out_what_a_rollback_undid(log: FeedbackLog):
    """Both reads of taught corrections (the gate's, newest first; rehearsal's, oldest first after a seq) skip the
    entries trained by a version in an undone range (lo, hi]; ratings are never among them."""
    seqs = [log.append(**submission(f"r{i}", correction=f"Fact {i}."))[0].seq for i in range(5)]
    rating = log.append(**submission("thumb"))[0].seq
    for version, seq in enumerate(seqs, start=1):
        log.mark_trained([seq], version)
    log.mark_trained([rating], 5)
    assert [e.seq for e in log.trained_corrections(10)] == seqs[::-1]
    assert [e.seq for e in log.trained_corrections(10, [[1, 3]])] == [seqs[4], seqs[3], seqs[0]]
    assert [e.seq for e in log.trained_corrections(2, [[1, 3], [3, 5]])] == [seqs[0]]
    assert [e.seq for e in log.trained_corrections_after(seqs[0], 10, [[1, 3]])] == seqs[3:]
    assert log.trained_corrections(10, [[0, 5]]) == []


def test_the_oldest_queued_entry_of_a_class_outside_a_batch(log: FeedbackLog):
    """What a batch in training yields to: the longest-waiting queued correction that is not its own."""
    seqs = [log.append(**submission(f"r{i}", correction=f"Fact {i}."))[0].seq for i in range(3)]
    thumb = log.append(**submission("thumb"))[0]
    created = {e.seq: e.created_s for e in log.read()}
    assert log.oldest_queued("correction") == created[seqs[0]]
    assert log.oldest_queued("correction", excluding=seqs[:2]) == created[seqs[2]]
    assert log.oldest_queued("correction", excluding=seqs) is None
    assert log.oldest_queued("thumbs_up") == thumb.created_s
    log.mark_trained(seqs[2:], 1)
    assert log.oldest_queued("correction", excluding=seqs[:2]) is None  # trained: no longer waiting


def test_a_quarantined_entry_is_settled_for_now_and_released_first_in_line(log: FeedbackLog):
    seqs = [log.append(**submission(f"r{i}"))[0].seq for i in range(3)]
    assert log.mark_quarantined(seqs[0], "loss is nan", float("nan")) and not log.mark_quarantined(seqs[0], "x", 1.0)
    held = log.get(seqs[0])
    assert (held.state, held.quarantine_reason, held.quarantine_loss) == ("quarantined", "loss is nan", None)
    assert log.settled_through() == seqs[0] and log.state_counts()["quarantined"] == 1  # held: settled for now
    assert [e.seq for e in log.next_queued(10)] == seqs[1:] and log.queued_seqs() == [(s, "sft") for s in seqs[1:]]
    assert log.mark_trained(seqs[1:], 2) == 2 and log.settled_through() == seqs[-1]
    assert log.release([seqs[0], seqs[1], 999]) == [seqs[0]]  # only a held entry is released
    released = log.get(seqs[0])
    assert (released.state, released.settled_s, released.quarantine_reason) == ("queued", None, "loss is nan")
    assert released.released_s is not None and [e.seq for e in log.quarantined()] == [seqs[0]]
    assert log.queued_seqs() == []  # behind the position on purpose: restore must not settle it
    new = log.append(**submission("later", correction="A correction."))[0].seq
    assert [e.seq for e in log.next_queued(10)] == [seqs[0], new]  # released first, even before corrections
    log.mark_trained([seqs[0]], 4)
    assert log.quarantined() == [] and log.get(seqs[0]).trained_version == 4


def test_one_key_takes_at_most_its_share_while_others_wait_and_fills_the_rest(log: FeedbackLog):
    """A flood from one key: each other key's entries get their places first, the flood's excess waits in line
    (still queued, never dropped) and fills what is left; entries without a key count as one key."""
    flood = [log.append(**submission(f"m{i}", correction="Wrong.", key_name="mallory"))[0].seq for i in range(6)]
    alice = [log.append(**submission(f"a{i}", key_name="alice"))[0].seq for i in range(2)]
    anonymous = log.append(**submission("n0"))[0].seq
    assert log.get(flood[0]).key_name == "mallory" and log.get(anonymous).key_name is None
    assert [e.seq for e in log.next_queued(4)] == flood[:4]  # no cap: corrections first, oldest first
    assert [e.seq for e in log.next_queued(4, per_key=2)] == [*flood[:2], *alice]
    assert [e.seq for e in log.next_queued(8, per_key=2)] == [*flood[:2], *alice, anonymous, *flood[2:5]]
    log.mark_trained([*flood[:2], *alice, anonymous], 1)
    assert [e.seq for e in log.next_queued(4, per_key=2)] == flood[2:]  # nobody else waits: the flood fills it


def test_a_version_3_file_gains_the_key_name(tmp_path: Path):
    path = tmp_path / "feedback.sqlite"
    log = FeedbackLog(path)
    seq = log.append(**submission("r0"))[0].seq
    log._conn.execute("ALTER TABLE feedback DROP COLUMN key_name")
    log._conn.execute("PRAGMA user_version = 3")
    log.close()
    log = FeedbackLog(path)
    try:
        assert log.get(seq).key_name is None and log.get(seq).state == "queued"
        assert log.append(**submission("r1", key_name="bob"))[0].key_name == "bob"
        assert log._conn.execute("PRAGMA user_version").fetchone()[0] == VERSION == 4
    finally:
        log.close()


VERSION_1_TABLE = """
CREATE TABLE feedback (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, idempotency_key TEXT NOT NULL UNIQUE, response_id TEXT NOT NULL,
    kind TEXT NOT NULL CHECK (kind IN ('sft', 'negative', 'preference')), rating INTEGER CHECK (rating IN (1, -1)),
    correction TEXT, preferred_over TEXT, prompt_token_ids BLOB NOT NULL, response_token_ids BLOB NOT NULL,
    output_token_ids BLOB NOT NULL, rejected_token_ids BLOB, adapter_version INTEGER NOT NULL,
    recorded INTEGER NOT NULL, created_s REAL NOT NULL
)
"""


def test_a_version_1_file_is_migrated_and_keeps_its_entries(tmp_path: Path):
    """A log written before comments, client ids and states (the table as the first release made it) opens: its
    entries read back queued, a retry of one finds it, and new entries have every field."""
    from alchemist.feedback.log import encode_ids, idempotency_key

    path = tmp_path / "feedback.sqlite"
    with sqlite3.connect(path) as old:
        old.execute("PRAGMA journal_mode=WAL")
        old.execute(VERSION_1_TABLE)
        old.execute(
            "INSERT INTO feedback VALUES (NULL, ?, 'chatcmpl-old', 'sft', 1, NULL, NULL, ?, ?, ?, NULL, 2, 1, 1.5)",
            (idempotency_key("chatcmpl-old", 1, None, None), encode_ids([1, 2]), encode_ids([3]), encode_ids([3])),
        )
    log = FeedbackLog(path)
    try:
        [old_entry] = log.read()
        assert (old_entry.seq, old_entry.response_id, old_entry.prompt_token_ids, old_entry.adapter_version) == (
            1, "chatcmpl-old", [1, 2], 2
        )  # fmt: skip
        assert (old_entry.state, old_entry.comment, old_entry.metadata, old_entry.feedback_id) == (
            "queued", None, None, None
        )  # fmt: skip
        retried, created = log.append(**submission("chatcmpl-old", prompt_token_ids=[1, 2]))
        assert not created and retried == old_entry
        new, _ = log.append(**submission("chatcmpl-new", comment="ok", feedback_id="c-1", metadata={"k": 1}))
        assert new.seq == 2 and log.find_feedback_id("c-1") == new
        assert log._conn.execute("PRAGMA user_version").fetchone()[0] == VERSION
    finally:
        log.close()
    reopened = FeedbackLog(path)  # a migrated file opens again as it is
    try:
        assert [e.seq for e in reopened.read()] == [1, 2]
    finally:
        reopened.close()


def test_a_version_2_file_is_rebuilt_with_the_quarantined_state(tmp_path: Path):
    """Version 2's state CHECK allowed no "quarantined": the table is made again, its rows, states, indexes and
    seq counter kept."""
    path = tmp_path / "feedback.sqlite"
    log = FeedbackLog(path)
    seqs = [log.append(**submission(f"r{i}", feedback_id=f"c-{i}"))[0].seq for i in range(3)]
    log.mark_trained(seqs[:1], 2)
    log._conn.execute("DELETE FROM feedback WHERE seq = ?", (seqs[2],))  # the counter must not step back
    log.close()
    with sqlite3.connect(path) as old:  # back to version 2: its columns and CHECK
        old.execute("ALTER TABLE feedback RENAME TO v3")
        old.execute(VERSION_1_TABLE)
        old.execute(
            "ALTER TABLE feedback ADD COLUMN state TEXT NOT NULL DEFAULT 'queued' "
            "CHECK (state IN ('queued', 'trained', 'skipped'))"
        )
        for name in ("comment", "feedback_id", "metadata", "trained_version", "skip_reason", "settled_s"):
            old.execute(f"ALTER TABLE feedback ADD COLUMN {name}")
        old.execute("INSERT INTO feedback SELECT seq, idempotency_key, response_id, kind, rating, correction, "
                    "preferred_over, prompt_token_ids, response_token_ids, output_token_ids, rejected_token_ids, "
                    "adapter_version, recorded, created_s, state, comment, feedback_id, metadata, trained_version, "
                    "skip_reason, settled_s FROM v3")  # fmt: skip
        old.execute("DROP TABLE v3")
        old.execute("UPDATE sqlite_sequence SET seq = ? WHERE name = 'feedback'", (seqs[2],))
        old.execute("PRAGMA user_version = 2")
    log = FeedbackLog(path)
    try:
        assert [(e.seq, e.state, e.trained_version) for e in log.read()] == [(seqs[0], "trained", 2),
                                                                            (seqs[1], "queued", None)]  # fmt: skip
        assert log.mark_quarantined(seqs[1], "loss is inf", float("inf"))
        assert log.find_feedback_id("c-1").state == "quarantined"
        assert log.append(**submission("new"))[0].seq == seqs[2] + 1
        indexes = {row[1] for row in log._conn.execute("PRAGMA index_list(feedback)")}
        assert {"feedback_by_client_id", "feedback_queued"} <= indexes
    finally:
        log.close()


def test_a_file_from_a_newer_version_is_refused(tmp_path: Path):
    path = tmp_path / "feedback.sqlite"
    with sqlite3.connect(path) as newer:
        newer.execute("PRAGMA user_version = 99")
    with pytest.raises(ValueError, match="newer"):
        FeedbackLog(path)
