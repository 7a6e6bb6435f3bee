"""What only the SQLite log has: WAL mode with full sync, and its schema's migrations (a file from every earlier
version opens, one from a newer version is refused). The contract it shares: tests/feedback/test_log.py."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from alchemist.feedback.schema import VERSION
from alchemist.feedback.sqlite_log import SQLiteFeedbackLog
from tests.feedback.test_log import submission


def test_wal_mode_and_full_sync(tmp_path: Path):
    log = SQLiteFeedbackLog(tmp_path / "data" / "feedback.sqlite")  # the directory does not exist yet
    try:
        log.append(**submission())
        assert log.path.with_name(log.path.name + "-wal").exists()
        with sqlite3.connect(log.path) as other:  # WAL is a property of the file, seen by every connection
            assert other.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert log._conn.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL: fsync on every commit
    finally:
        log.close()


def test_a_version_3_file_gains_the_key_name(tmp_path: Path):
    path = tmp_path / "feedback.sqlite"
    log = SQLiteFeedbackLog(path)
    seq = log.append(**submission("r0"))[0].seq
    log._conn.execute("ALTER TABLE feedback DROP COLUMN key_name")
    log._conn.execute("PRAGMA user_version = 3")
    log.close()
    log = SQLiteFeedbackLog(path)
    try:
        assert log.get(seq).key_name is None and log.get(seq).state == "queued"
        assert log.append(**submission("r1", key_name="bob"))[0].key_name == "bob"
        assert log._conn.execute("PRAGMA user_version").fetchone()[0] == VERSION
    finally:
        log.close()


def test_a_version_4_file_gains_the_adapter(tmp_path: Path):
    """Entries logged before adapters trained are the shared adapter's (NULL), and stay in its queue."""
    path = tmp_path / "feedback.sqlite"
    log = SQLiteFeedbackLog(path)
    seq = log.append(**submission("r0"))[0].seq
    log._conn.execute("ALTER TABLE feedback DROP COLUMN adapter")
    log._conn.execute("PRAGMA user_version = 4")
    log.close()
    log = SQLiteFeedbackLog(path)
    try:
        assert log.get(seq).adapter is None and [e.seq for e in log.next_queued(10)] == [seq]
        assert log.append(**submission("r1", adapter="team-a"))[0].adapter == "team-a"
        assert log._conn.execute("PRAGMA user_version").fetchone()[0] == VERSION == 5
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
    log = SQLiteFeedbackLog(path)
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
        assert new.seq == 2 and log.find(feedback_id="c-1") == new
        assert log._conn.execute("PRAGMA user_version").fetchone()[0] == VERSION
    finally:
        log.close()
    reopened = SQLiteFeedbackLog(path)  # a migrated file opens again as it is
    try:
        assert [e.seq for e in reopened.read()] == [1, 2]
    finally:
        reopened.close()


def test_a_version_2_file_is_rebuilt_with_the_quarantined_state(tmp_path: Path):
    """Version 2's state CHECK allowed no "quarantined": the table is made again, its rows, states, indexes and
    seq counter kept."""
    path = tmp_path / "feedback.sqlite"
    log = SQLiteFeedbackLog(path)
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
    log = SQLiteFeedbackLog(path)
    try:
        assert [(e.seq, e.state, e.trained_version) for e in log.read()] == [(seqs[0], "trained", 2),
                                                                            (seqs[1], "queued", None)]  # fmt: skip
        assert log.mark_quarantined(seqs[1], "loss is inf", float("inf"))
        assert log.find(feedback_id="c-1").state == "quarantined"
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
        SQLiteFeedbackLog(path)
