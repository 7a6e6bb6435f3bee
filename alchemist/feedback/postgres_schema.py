"""The PostgreSQL feedback log's tables (``alchemist.feedback.postgres_log``), created on first connect.

The table is the SQLite log's (``alchemist.feedback.schema``, version 5) in PostgreSQL's types, plus the claim:
``claimed_by``, the owner id of the log (one per process, ``PostgresFeedbackLog``) whose trainer has the entry in
its next batch. ``feedback_schema`` holds the version; ``migrate`` creates what is missing in one transaction under
an advisory lock (two replicas connecting at once: the second waits, then finds it done) and refuses a database
from a newer version. Version 1 is the first; version 2 adds ``adapter`` (the named adapter that served the
response and that the entry trains; NULL: the shared one, as every entry of version 1 was), added in place to a
version-1 table.
"""

from __future__ import annotations

import psycopg

from alchemist.feedback.log import KINDS, STATES

VERSION = 2

# The two-key advisory locks the log takes (pg_locks' objsubid 2): its own class, so that they never meet an owner's
# one-key lock (objsubid 1, ``PostgresFeedbackLog``) nor, but by a 1-in-2^32 chance, another application's.
LOCK_CLASS = 0x416C6368  # "Alch"
SCHEMA_LOCK = 1  # creating or migrating the tables
APPEND_LOCK = 2  # appends one at a time: seqs commit in their order (a reader never sees seq n + 1 before n)


def _one_of(values: tuple[str, ...]) -> str:
    return ", ".join(f"'{v}'" for v in values)


TABLES = (
    "CREATE TABLE IF NOT EXISTS feedback_schema (version INTEGER NOT NULL)",
    f"""CREATE TABLE IF NOT EXISTS feedback (
        seq BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,  -- a sequence: a seq is never reused
        idempotency_key TEXT NOT NULL UNIQUE,
        response_id TEXT NOT NULL,
        kind TEXT NOT NULL CHECK (kind IN ({_one_of(KINDS)})),
        rating SMALLINT CHECK (rating IN (1, -1)),
        correction TEXT,
        preferred_over TEXT,
        prompt_token_ids BYTEA NOT NULL,  -- little-endian int32, as in SQLite (log.encode_ids)
        response_token_ids BYTEA NOT NULL,
        output_token_ids BYTEA NOT NULL,
        rejected_token_ids BYTEA,
        adapter_version INTEGER NOT NULL,
        recorded BOOLEAN NOT NULL,
        created_s DOUBLE PRECISION NOT NULL,
        comment TEXT,
        feedback_id TEXT,
        metadata TEXT,  -- the client's JSON object as sent (not JSONB: it would reorder the keys)
        state TEXT NOT NULL DEFAULT 'queued' CHECK (state IN ({_one_of(STATES)})),
        trained_version INTEGER,
        skip_reason TEXT,
        settled_s DOUBLE PRECISION,
        quarantine_reason TEXT,
        quarantine_loss DOUBLE PRECISION,  -- NULL for NaN, as in SQLite
        quarantined_s DOUBLE PRECISION,
        released_s DOUBLE PRECISION,
        key_name TEXT,
        adapter TEXT,  -- the named adapter that served the response, which it trains (NULL: the shared one)
        claimed_by BIGINT  -- the owner whose trainer holds it in its next batch (valid while that owner lives)
    )""",
    "CREATE UNIQUE INDEX IF NOT EXISTS feedback_by_client_id ON feedback (feedback_id) WHERE feedback_id IS NOT NULL",
    "CREATE INDEX IF NOT EXISTS feedback_queued ON feedback (kind, seq) WHERE state = 'queued'",
)


def migrate(conn: psycopg.Connection) -> None:
    """Creates the tables if missing; a database from a newer version is refused. ``conn`` is in autocommit mode, with
    dict rows."""
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s, %s)", (LOCK_CLASS, SCHEMA_LOCK))
        for statement in TABLES:
            conn.execute(statement)
        version = conn.execute("SELECT MAX(version) AS version FROM feedback_schema").fetchone()["version"]
        if version is not None and version > VERSION:
            raise ValueError(f"feedback log schema version {version} is newer than this Alchemist's ({VERSION})")
        conn.execute("ALTER TABLE feedback ADD COLUMN IF NOT EXISTS adapter TEXT")  # version 1's table lacks it
        if version is None:
            conn.execute("INSERT INTO feedback_schema (version) VALUES (%s)", (VERSION,))
        elif version < VERSION:
            conn.execute("UPDATE feedback_schema SET version = %s", (VERSION,))
