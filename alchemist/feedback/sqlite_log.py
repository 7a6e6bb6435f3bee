"""The feedback log (``alchemist.feedback.log.FeedbackLog``) in one SQLite file, for one server process.

    log = SQLiteFeedbackLog("alchemist-data/feedback.sqlite")

The database runs in WAL mode with ``synchronous=FULL``: a commit fsyncs the WAL, so ``append`` (and a change of
state) returns only after the row is on disk. Token ids are stored as little-endian int32 blobs. The table and its
migrations: ``alchemist.feedback.schema``.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from alchemist.feedback.log import (
    CLASS,
    CLASSES,
    INSERTED,
    KINDS,
    STATES,
    FeedbackEntry,
    Listeners,
    entry_from_row,
    new_row,
)
from alchemist.feedback.schema import migrate

_INSERT = f"INSERT INTO feedback ({', '.join(INSERTED)}) VALUES ({', '.join('?' * len(INSERTED))})"
_COUNTED = {"kind": KINDS, "state": STATES}  # what counts() groups by, and the values it always answers
_OF_ADAPTER = "adapter IS :adapter"  # IS: an entry of the shared adapter has NULL, which = never matches


class SQLiteFeedbackLog:
    """Thread-safe: one connection behind a lock (HTTP threads append, the trainer reads). The methods' contracts
    are ``FeedbackLog``'s."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # isolation_level=None: no implicit transactions; append() opens and commits its own.
        self._conn = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._conn.row_factory = sqlite3.Row
        self._lock = threading.Lock()
        self._listeners = Listeners()
        with self._lock:
            mode = self._conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if mode.lower() != "wal":
                raise ValueError(f"feedback_db {self.path}: SQLite refused WAL mode (got {mode!r})")
            # FULL: a commit in WAL mode fsyncs the WAL, so an acknowledged append survives power loss too.
            self._conn.execute("PRAGMA synchronous=FULL")
            self._conn.execute("PRAGMA busy_timeout=10000")  # another process (a reader, a tool) may hold a lock
            migrate(self._conn)

    def append(
        self,
        *,
        response_id: str,
        kind: str,
        prompt_token_ids: Sequence[int],
        response_token_ids: Sequence[int],
        output_token_ids: Sequence[int],
        adapter_version: int,
        recorded: bool,
        rating: int | None = None,
        correction: str | None = None,
        preferred_over: str | None = None,
        rejected_token_ids: Sequence[int] | None = None,
        comment: str | None = None,
        feedback_id: str | None = None,
        metadata: dict[str, Any] | None = None,
        key_name: str | None = None,
        adapter: str | None = None,
    ) -> tuple[FeedbackEntry, bool]:
        key, row = new_row(
            response_id=response_id, kind=kind, prompt_token_ids=prompt_token_ids,
            response_token_ids=response_token_ids, output_token_ids=output_token_ids, adapter_version=adapter_version,
            recorded=recorded, rating=rating, correction=correction, preferred_over=preferred_over,
            rejected_token_ids=rejected_token_ids, comment=comment, feedback_id=feedback_id, metadata=metadata,
            key_name=key_name, adapter=adapter,
        )
        with self._lock:
            # Look, then insert, in one write transaction (IMMEDIATE: other processes wait at BEGIN, not at COMMIT).
            # Not INSERT ... ON CONFLICT DO NOTHING: a refused insert still uses up an AUTOINCREMENT seq.
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                entry = self._find(key)
                created = entry is None
                if created:
                    self._conn.execute(_INSERT, row)
                    entry = self._find(key)
                self._conn.execute("COMMIT")
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
        assert entry is not None
        if created:
            self._listeners.notify(entry)  # after the commit, outside the lock: a listener may read the log
        return entry, created

    def add_listener(self, callback: Callable[[FeedbackEntry], None]) -> None:
        self._listeners.add(callback)

    def close(self) -> None:
        with self._lock:
            self._conn.close()  # the last connection to close checkpoints the WAL into the main file

    def get(self, seq: int) -> FeedbackEntry | None:
        return self._one("SELECT * FROM feedback WHERE seq = ?", (seq,))

    def find(self, key: str | None = None, *, feedback_id: str | None = None) -> FeedbackEntry | None:
        if (key is None) == (feedback_id is None):
            raise ValueError("find needs an idempotency key or a feedback_id (one of the two)")
        if key is None:
            return self._one("SELECT * FROM feedback WHERE feedback_id = ?", (feedback_id,))
        with self._lock:
            return self._find(key)

    def next_queued(
        self, limit: int, per_key: int | None = None, own: str | None = None, adapter: str | None = None
    ) -> list[FeedbackEntry]:
        mine = "instr(response_id, :own) = 0, " if own else ""
        order = f"released_s IS NULL, {CLASS} != 'correction', {mine}seq"
        return self._all(
            f"SELECT * FROM (SELECT *, ROW_NUMBER() OVER (PARTITION BY COALESCE(key_name, '') ORDER BY {order}) "
            f"AS nth FROM feedback WHERE state = 'queued' AND {_OF_ADAPTER}) ORDER BY nth > :per_key, {order} "
            "LIMIT :limit",
            {"per_key": per_key if per_key is not None else limit, "limit": limit, "own": own, "adapter": adapter},
        )

    def mark_trained(self, seqs: Sequence[int], version: int | None) -> int:
        return self._settle(seqs, "state = 'trained', trained_version = ?", (version,))

    def mark_skipped(self, seqs: Sequence[int], reason: str) -> int:
        if not reason:
            raise ValueError("a skipped entry needs its reason")
        return self._settle(seqs, "state = 'skipped', skip_reason = ?", (reason,))

    def skip_queued_before(
        self, classes: Sequence[str], created_before_s: float, reason: str, adapter: str | None = None
    ) -> int:
        if not classes:
            return 0
        marks = ", ".join("?" * len(classes))
        with self._lock:
            return self._conn.execute(
                f"UPDATE feedback SET state = 'skipped', skip_reason = ?, settled_s = ? "
                f"WHERE state = 'queued' AND COALESCE(released_s, created_s) < ? AND {CLASS} IN ({marks}) "
                "AND adapter IS ?",
                (reason, time.time(), created_before_s, *classes, adapter),
            ).rowcount

    def mark_quarantined(self, seq: int, reason: str, loss: float) -> bool:
        # A NaN loss is stored as NULL (SQLite binds NaN as NULL).
        assignment = "state = 'quarantined', quarantine_reason = ?, quarantine_loss = ?, quarantined_s = ?"
        return self._settle([seq], assignment, (reason, loss, time.time())) == 1

    def release(self, seqs: Sequence[int]) -> list[int]:
        if not seqs:
            return []
        marks = ", ".join("?" * len(seqs))
        with self._lock:
            rows = self._conn.execute(
                f"UPDATE feedback SET state = 'queued', released_s = ?, settled_s = NULL "
                f"WHERE state = 'quarantined' AND seq IN ({marks}) RETURNING seq",
                (time.time(), *map(int, seqs)),
            ).fetchall()
        return sorted(seq for (seq,) in rows)

    def oldest_queued(self, cls: str, excluding: Sequence[int] = (), adapter: str | None = None) -> float | None:
        marks = ", ".join("?" * len(excluding))
        with self._lock:
            return self._conn.execute(
                f"SELECT MIN(COALESCE(released_s, created_s)) FROM feedback WHERE state = 'queued' AND {CLASS} = ? "
                f"AND adapter IS ? AND seq NOT IN ({marks})", (cls, adapter, *excluding),
            ).fetchone()[0]  # fmt: skip

    def settled_through(self, excluding: Sequence[int] = (), adapter: str | None = None) -> int:
        marks = ", ".join("?" * len(excluding))
        with self._lock:  # one read transaction: an append in between cannot slip under the answer
            self._conn.execute("BEGIN")
            try:
                last = self._conn.execute("SELECT COALESCE(MAX(seq), 0) FROM feedback").fetchone()[0]
                first = self._conn.execute(
                    f"SELECT MIN(seq) FROM feedback WHERE state = 'queued' AND adapter IS ? AND seq NOT IN ({marks})",
                    (adapter, *excluding),
                ).fetchone()[0]
            finally:
                self._conn.execute("COMMIT")
        return last if first is None else first - 1

    def queued_seqs(self, through_seq: int | None = None, adapter: str | None = None) -> list[tuple[int, str]]:
        with self._lock:
            rows = self._conn.execute(
                "SELECT seq, kind FROM feedback WHERE state = 'queued' AND released_s IS NULL AND seq <= ? "
                "AND adapter IS ? ORDER BY seq",
                (through_seq if through_seq is not None else 2**62, adapter),
            ).fetchall()
        return [(seq, kind) for seq, kind in rows]

    def read(self, after_seq: int = 0, limit: int = 100, state: str | None = None) -> list[FeedbackEntry]:
        if limit < 1:
            raise ValueError(f"limit must be positive (got {limit})")
        where = "seq > ?" + ("" if state is None else " AND state = ?")
        args = (after_seq,) + (() if state is None else (state,))
        return self._all(f"SELECT * FROM feedback WHERE {where} ORDER BY seq LIMIT ?", (*args, limit))

    def last_seq(self) -> int:
        with self._lock:
            return self._conn.execute("SELECT COALESCE(MAX(seq), 0) FROM feedback").fetchone()[0]

    def counts(self, by: str) -> dict[str, int]:
        if by not in _COUNTED:
            raise ValueError(f"counts are by 'kind' or 'state' (got {by!r})")
        with self._lock:  # ``by`` is one of two column names, never the caller's text
            rows = self._conn.execute(f"SELECT {by}, COUNT(*) FROM feedback GROUP BY {by}").fetchall()
        return {value: 0 for value in _COUNTED[by]} | dict(rows)

    def backlog(self) -> dict[str, tuple[int, float | None]]:
        with self._lock:
            rows = self._conn.execute(
                f"SELECT {CLASS}, COUNT(*), MIN(created_s) FROM feedback WHERE state = 'queued' GROUP BY 1"
            ).fetchall()
        return {c: (0, None) for c in CLASSES} | {c: (n, oldest) for c, n, oldest in rows}

    def backlog_by_adapter(self) -> dict[str | None, int]:
        with self._lock:
            rows = self._conn.execute("SELECT adapter, COUNT(*) FROM feedback WHERE state = 'queued' GROUP BY 1")
            return dict(rows.fetchall())

    def quarantined(self) -> list[FeedbackEntry]:
        return self._all(
            "SELECT * FROM feedback WHERE state = 'quarantined' OR (state = 'queued' AND released_s IS NOT NULL) "
            "ORDER BY seq", ()
        )  # fmt: skip

    def trained_corrections(
        self, limit: int, after_seq: int = 0, before_seq: int | None = None, newest_first: bool = False,
        adapter: str | None = None,
    ) -> list[FeedbackEntry]:  # fmt: skip
        return self._all(
            "SELECT * FROM feedback WHERE state = 'trained' AND correction IS NOT NULL AND seq > ? AND seq < ? "
            f"AND adapter IS ? ORDER BY seq{' DESC' if newest_first else ''} LIMIT ?",
            (after_seq, before_seq if before_seq is not None else 2**62, adapter, limit),
        )

    def ratings(self, adapter: str | None = None) -> dict[tuple[int, str | None], tuple[int, int]]:
        with self._lock:
            rows = self._conn.execute(
                "SELECT adapter_version, key_name, SUM(rating = 1), SUM(rating = -1) FROM feedback "
                "WHERE rating IS NOT NULL AND adapter IS ? GROUP BY 1, 2", (adapter,),
            ).fetchall()  # fmt: skip
        return {(version, key): (up, down) for version, key, up, down in rows}

    def _one(self, query: str, args: tuple) -> FeedbackEntry | None:
        with self._lock:
            row = self._conn.execute(query, args).fetchone()
        return None if row is None else entry_from_row(row)

    def _all(self, query: str, args: tuple | dict) -> list[FeedbackEntry]:
        with self._lock:
            rows = self._conn.execute(query, args).fetchall()
        return [entry_from_row(r) for r in rows]

    def _settle(self, seqs: Sequence[int], assignment: str, args: tuple) -> int:
        if not seqs:
            return 0
        marks = ", ".join("?" * len(seqs))
        query = f"UPDATE feedback SET {assignment}, settled_s = ? WHERE state = 'queued' AND seq IN ({marks})"
        with self._lock:  # one statement: its own transaction, durable (synchronous=FULL) when it returns
            return self._conn.execute(query, (*args, time.time(), *map(int, seqs))).rowcount

    def _find(self, key: str) -> FeedbackEntry | None:
        row = self._conn.execute("SELECT * FROM feedback WHERE idempotency_key = ?", (key,)).fetchone()
        return None if row is None else entry_from_row(row)

