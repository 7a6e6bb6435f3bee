"""The SQLite feedback log's table (``alchemist.feedback.sqlite_log``), and the migration that brings a file
written by an older version up to it.

The log is durable state: a file from any earlier version must open. ``PRAGMA user_version`` says which schema a
file has; ``migrate`` adds what is missing, in one transaction, and sets it. Columns are only ever added (SQLite's
ALTER TABLE ADD COLUMN rewrites nothing: old rows read the column's default).

Version 1 (the first): the entry as the server acknowledged it. Version 2 adds what clients send beside it
(``comment``, their ``feedback_id``, a ``metadata`` JSON object) and what became of the entry: ``state`` (queued,
trained, skipped), ``trained_version``, ``skip_reason``, ``settled_s``. Rows of a version-1 file are "queued";
the online trainer settles those it had passed before (``OnlineTrainer.restore``). Version 3 adds the state
"quarantined" (the poisoning guard holds the entry out of training until an admin releases it,
``alchemist.training.quarantine``) and its columns: ``quarantine_reason``, ``quarantine_loss``, ``quarantined_s``,
``released_s``. A state's CHECK cannot be altered in place: a version-2 table is rebuilt (``_rebuild``), seqs kept.
Version 4 adds ``key_name``: the name of the API key that gave the entry (NULL: no keys configured, or logged
before version 4), so that the trainer can cap one key's share of a batch. Version 5 adds ``adapter``: the named
adapter that served the response and that the entry trains (NULL: the shared adapter, as every entry before version
5 was), so that each adapter's trainer reads its own queue.
"""

from __future__ import annotations

import sqlite3

from alchemist.feedback.log import STATES

VERSION = 5

TABLE = """
CREATE TABLE IF NOT EXISTS feedback (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,  -- AUTOINCREMENT: a seq is never reused, even after a delete
    idempotency_key TEXT NOT NULL UNIQUE,
    response_id TEXT NOT NULL,
    kind TEXT NOT NULL CHECK (kind IN ('sft', 'negative', 'preference')),
    rating INTEGER CHECK (rating IN (1, -1)),
    correction TEXT,
    preferred_over TEXT,
    prompt_token_ids BLOB NOT NULL,
    response_token_ids BLOB NOT NULL,
    output_token_ids BLOB NOT NULL,
    rejected_token_ids BLOB,
    adapter_version INTEGER NOT NULL,
    recorded INTEGER NOT NULL,
    created_s REAL NOT NULL
)
"""
# The columns added since version 1, as ALTER TABLE adds them (so a fresh file and a migrated one are the same table).
ADDED_COLUMNS = {
    "comment": "TEXT",
    "feedback_id": "TEXT",  # the client's own id for the submission
    "metadata": "TEXT",  # a JSON object
    "state": f"TEXT NOT NULL DEFAULT 'queued' CHECK (state IN ({', '.join(repr(s) for s in STATES)}))",
    "trained_version": "INTEGER",
    "skip_reason": "TEXT",
    "settled_s": "REAL",  # when the state left "queued"
    "quarantine_reason": "TEXT",  # why the poisoning guard held it (kept after a release)
    "quarantine_loss": "REAL",  # the loss it had then (NULL for NaN)
    "quarantined_s": "REAL",
    "released_s": "REAL",  # when an admin released it: it trains next, unchecked
    "key_name": "TEXT",  # the API key that gave it (its name in the keys file)
    "adapter": "TEXT",  # the named adapter that served the response, which it trains (NULL: the shared one)
}
INDEXES = (
    # A client's feedback_id names one entry; most entries have none.
    "CREATE UNIQUE INDEX IF NOT EXISTS feedback_by_client_id ON feedback (feedback_id) WHERE feedback_id IS NOT NULL",
    # The trainer's queue and the backlog: queued entries by kind, oldest first.
    "CREATE INDEX IF NOT EXISTS feedback_queued ON feedback (kind, seq) WHERE state = 'queued'",
)


def migrate(conn: sqlite3.Connection) -> None:
    """Creates the table, or brings an older file's up to ``VERSION``; a file from a newer version is refused.
    ``conn`` must be in autocommit mode (isolation_level None): the migration is one explicit transaction."""
    conn.execute("BEGIN IMMEDIATE")  # two processes opening one old file: the second waits, then finds it done
    try:
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if version > VERSION:
            raise ValueError(f"feedback log schema version {version} is newer than this Alchemist's ({VERSION})")
        conn.execute(TABLE)
        present = {row[1] for row in conn.execute("PRAGMA table_info(feedback)")}
        if "state" in present and "quarantine_reason" not in present:  # version 2: its state CHECK is too narrow
            _rebuild(conn, present)
            present = {row[1] for row in conn.execute("PRAGMA table_info(feedback)")}
        for name, declaration in ADDED_COLUMNS.items():
            if name not in present:
                conn.execute(f"ALTER TABLE feedback ADD COLUMN {name} {declaration}")
        for index in INDEXES:
            conn.execute(index)
        if version != VERSION:
            conn.execute(f"PRAGMA user_version = {VERSION}")
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise


def _rebuild(conn: sqlite3.Connection, columns: set[str]) -> None:
    """The table made again with this version's declarations and the old rows (seqs and the AUTOINCREMENT counter
    kept); SQLite's own recipe for a changed constraint. Runs inside ``migrate``'s transaction."""
    conn.execute("ALTER TABLE feedback RENAME TO feedback_old")
    conn.execute(TABLE)
    for name, declaration in ADDED_COLUMNS.items():
        conn.execute(f"ALTER TABLE feedback ADD COLUMN {name} {declaration}")
    names = ", ".join(sorted(columns))
    conn.execute(f"INSERT INTO feedback ({names}) SELECT {names} FROM feedback_old")
    counter = conn.execute("SELECT seq FROM sqlite_sequence WHERE name = 'feedback_old'").fetchone()
    conn.execute("DROP TABLE feedback_old")  # and its indexes: migrate makes them again, on the new table
    if counter is not None:
        conn.execute("DELETE FROM sqlite_sequence WHERE name = 'feedback'")
        conn.execute("INSERT INTO sqlite_sequence (name, seq) VALUES ('feedback', ?)", counter)
