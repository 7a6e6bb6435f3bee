"""The feedback log (``alchemist.feedback.log.FeedbackLog``) in a PostgreSQL database, shared by several processes
(replicas, each with its own trainer).

    log = PostgresFeedbackLog("postgresql://alchemist@db.example:5432/alchemist")

Same semantics as the SQLite log (``alchemist.feedback.sqlite_log``), with what several processes need on top:

- Durable: every write commits with ``synchronous_commit=on`` (set on the session, whatever the server's default),
  so ``append`` and a change of state return once the WAL is flushed.
- Seqs in commit order: appends take one advisory lock until they commit, so a reader never sees seq n + 1 before
  n (the trainer's ``read(after_seq=...)`` would skip n for good) and the seqs have no gaps; appends are serialized,
  milliseconds each.
- Exactly-once across processes: ``next_queued`` is a claim. SQLite's log relies on one process (its queue is a
  peek; only one trainer reads it); here each log has an owner id and ``next_queued`` claims what it returns, inside
  one transaction that picks the entries in training order among those nobody else holds, locks them with
  ``SELECT ... FOR UPDATE SKIP LOCKED`` (a concurrent claimant's rows are passed over, not waited on), marks them
  ``claimed_by`` the owner and gives back the owner's earlier claims that fell out of the head. A claim lasts as long
  as its owner's session: the owner holds a session advisory lock on its id, which PostgreSQL drops when the
  connection ends (a SIGKILLed process's socket closes at once; a vanished host's after the TCP keepalives set
  below), and then its claims are anyone's. Not a timed lease: that would have to be renewed through a training
  step of any length, and one step slower than the lease would be trained twice. Settling (``mark_*``) is
  owner-agnostic and idempotent, as in SQLite: only a queued entry changes.
- Listeners hear this process's appends, in the appending thread, as the Protocol says; another process's appends
  reach its trainer when its queue reads the log again (``alchemist.training.feedback_queue`` re-reads every
  ``POLICY_EVERY_S``). Not LISTEN/NOTIFY: it would need a connection and a thread per log to wake a trainer a second
  sooner, and feedback goes to the replica that holds its record, which hears it itself.

One connection behind a lock, as SQLite's (HTTP threads append while the trainer reads). A connection that breaks
fails the call in flight; the next call connects again under a new owner id (the old session's claims are released
with it). Tables: ``alchemist.feedback.postgres_schema``.
"""

from __future__ import annotations

import math
import random
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import psycopg
from psycopg.rows import dict_row

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
from alchemist.feedback.postgres_schema import APPEND_LOCK, LOCK_CLASS, migrate

_INSERT = f"INSERT INTO feedback ({', '.join(INSERTED)}) VALUES ({', '.join(['%s'] * len(INSERTED))}) RETURNING *"
_COUNTED = {"kind": KINDS, "state": STATES}
_OF_ADAPTER = "adapter IS NOT DISTINCT FROM %(adapter)s"  # an entry of the shared adapter has NULL: = never matches
# The owners alive now: those whose one-key advisory lock (objsubid 1) is held in this database.
_LIVE = """SELECT (classid::bigint << 32) | objid::bigint FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 1
    AND granted AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"""
_CLAIMABLE = f"(claimed_by IS NULL OR claimed_by = %(me)s OR claimed_by NOT IN ({_LIVE}))"
# Server-side TCP keepalives on the session: a host that vanishes without closing its socket is noticed (and its
# claims released) within about idle + interval * count seconds.
_SESSION = ("SET synchronous_commit = on", "SET tcp_keepalives_idle = 10", "SET tcp_keepalives_interval = 5",
            "SET tcp_keepalives_count = 3")  # fmt: skip


class PostgresFeedbackLog:
    """Thread-safe: one connection behind a lock. The methods' contracts are ``FeedbackLog``'s; ``next_queued``
    also claims what it returns for this log's owner (``owner``), see the module's docstring."""

    def __init__(self, url: str):
        self.url = url
        self._lock = threading.Lock()
        self._listeners = Listeners()
        with self._lock:
            self._connect()
            migrate(self._conn)

    def _connect(self) -> None:
        self._conn = psycopg.connect(self.url, autocommit=True, row_factory=dict_row)
        for setting in _SESSION:
            self._conn.execute(setting)
        self.owner = random.randrange(1, 2**62)  # this session's claims; positive, so pg_locks' halves rebuild it
        self._conn.execute("SELECT pg_advisory_lock(%s)", (self.owner,))  # held while the session lives

    def _db(self) -> psycopg.Connection:
        """The connection, made again (with a new owner) if the last one broke; call with the lock held."""
        if self._conn.broken:
            self._connect()
        return self._conn

    def _execute(self, query: str, args: tuple | dict = ()) -> psycopg.Cursor:
        return self._db().execute(query, args)

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
            db = self._db()
            # Look, then insert, under the append lock: no refused insert uses up a seq, and seqs commit in order.
            with db.transaction():
                db.execute("SELECT pg_advisory_xact_lock(%s, %s)", (LOCK_CLASS, APPEND_LOCK))
                found = db.execute("SELECT * FROM feedback WHERE idempotency_key = %s", (key,)).fetchone()
                created = found is None
                if created:
                    found = db.execute(_INSERT, row).fetchone()
        entry = entry_from_row(found)
        if created:
            self._listeners.notify(entry)  # after the commit, outside the lock: a listener may read the log
        return entry, created

    def add_listener(self, callback: Callable[[FeedbackEntry], None]) -> None:
        self._listeners.add(callback)

    def close(self) -> None:
        with self._lock:
            self._conn.close()  # ends the session: its advisory lock, and so its claims, go with it

    def get(self, seq: int) -> FeedbackEntry | None:
        return self._one("SELECT * FROM feedback WHERE seq = %s", (seq,))

    def find(self, key: str | None = None, *, feedback_id: str | None = None) -> FeedbackEntry | None:
        if (key is None) == (feedback_id is None):
            raise ValueError("find needs an idempotency key or a feedback_id (one of the two)")
        if key is None:
            return self._one("SELECT * FROM feedback WHERE feedback_id = %s", (feedback_id,))
        return self._one("SELECT * FROM feedback WHERE idempotency_key = %s", (key,))

    def next_queued(
        self, limit: int, per_key: int | None = None, own: str | None = None, adapter: str | None = None
    ) -> list[FeedbackEntry]:
        mine = "strpos(response_id, %(own)s) = 0, " if own else ""
        order = f"released_s IS NULL, {CLASS} != 'correction', {mine}seq"
        # The head in training order among the entries nobody else holds and not passed over (``skip``).
        head_query = (
            f"SELECT seq FROM (SELECT *, ROW_NUMBER() OVER (PARTITION BY COALESCE(key_name, '') ORDER BY {order}) "
            f"AS nth FROM feedback WHERE state = 'queued' AND {_OF_ADAPTER} AND {_CLAIMABLE} "
            "AND seq <> ALL(%(skip)s::bigint[])) AS q "
            f"ORDER BY nth > %(per_key)s, {order} LIMIT %(limit)s"
        )
        lock_query = (
            f"SELECT seq FROM feedback WHERE seq = ANY(%(want)s) AND state = 'queued' AND {_CLAIMABLE} "
            "FOR UPDATE SKIP LOCKED"
        )
        with self._lock:
            db = self._db()
            args: dict[str, Any] = {"me": self.owner, "per_key": per_key if per_key is not None else limit,
                                    "limit": limit, "skip": [], "own": own, "adapter": adapter}  # fmt: skip
            with db.transaction():
                # Each round locks the head's rows not yet locked; those another claimant holds locked are passed
                # over and the head is taken again without them, until every row of the head is this owner's.
                locked: set[int] = set()
                while True:
                    head = [r["seq"] for r in db.execute(head_query, args).fetchall()]
                    want = [seq for seq in head if seq not in locked]
                    if not want:
                        break
                    got = {r["seq"] for r in db.execute(lock_query, args | {"want": want}).fetchall()}
                    locked |= got
                    args["skip"] = [*args["skip"], *(seq for seq in want if seq not in got)]
                db.execute(
                    "UPDATE feedback SET claimed_by = NULL WHERE claimed_by = %(me)s AND state = 'queued' "
                    "AND seq <> ALL(%(head)s::bigint[])", {"me": self.owner, "head": head},
                )  # fmt: skip
                rows = db.execute(
                    "UPDATE feedback SET claimed_by = %(me)s WHERE seq = ANY(%(head)s) RETURNING *",
                    {"me": self.owner, "head": head},
                ).fetchall()
        by_seq = {r["seq"]: entry_from_row(r) for r in rows}
        return [by_seq[seq] for seq in head]

    def mark_trained(self, seqs: Sequence[int], version: int | None) -> int:
        return self._settle(seqs, "state = 'trained', trained_version = %s", (version,))

    def mark_skipped(self, seqs: Sequence[int], reason: str) -> int:
        if not reason:
            raise ValueError("a skipped entry needs its reason")
        return self._settle(seqs, "state = 'skipped', skip_reason = %s", (reason,))

    def skip_queued_before(
        self, classes: Sequence[str], created_before_s: float, reason: str, adapter: str | None = None
    ) -> int:
        if not classes:
            return 0
        with self._lock:
            return self._execute(
                f"UPDATE feedback SET state = 'skipped', skip_reason = %s, settled_s = %s "
                f"WHERE state = 'queued' AND COALESCE(released_s, created_s) < %s AND {CLASS} = ANY(%s) "
                "AND adapter IS NOT DISTINCT FROM %s",
                (reason, time.time(), created_before_s, list(classes), adapter),
            ).rowcount

    def mark_quarantined(self, seq: int, reason: str, loss: float) -> bool:
        loss = None if math.isnan(loss) else loss  # NaN is kept as NULL, as SQLite does
        assignment = "state = 'quarantined', quarantine_reason = %s, quarantine_loss = %s, quarantined_s = %s"
        return self._settle([seq], assignment, (reason, loss, time.time())) == 1

    def release(self, seqs: Sequence[int]) -> list[int]:
        if not seqs:
            return []
        with self._lock:
            rows = self._execute(
                "UPDATE feedback SET state = 'queued', released_s = %s, settled_s = NULL, claimed_by = NULL "
                "WHERE state = 'quarantined' AND seq = ANY(%s) RETURNING seq",
                (time.time(), [int(s) for s in seqs]),
            ).fetchall()
        return sorted(r["seq"] for r in rows)

    def oldest_queued(self, cls: str, excluding: Sequence[int] = (), adapter: str | None = None) -> float | None:
        with self._lock:
            return self._execute(
                f"SELECT MIN(COALESCE(released_s, created_s)) AS oldest FROM feedback WHERE state = 'queued' "
                f"AND {CLASS} = %s AND adapter IS NOT DISTINCT FROM %s AND seq <> ALL(%s::bigint[])",
                (cls, adapter, [int(s) for s in excluding]),
            ).fetchone()["oldest"]  # fmt: skip

    def settled_through(self, excluding: Sequence[int] = (), adapter: str | None = None) -> int:
        with self._lock:  # one statement, one snapshot: an append in between cannot slip under the answer
            row = self._execute(
                "SELECT (SELECT COALESCE(MAX(seq), 0) FROM feedback) AS last, (SELECT MIN(seq) FROM feedback "
                "WHERE state = 'queued' AND adapter IS NOT DISTINCT FROM %s AND seq <> ALL(%s::bigint[])) AS first",
                (adapter, [int(s) for s in excluding]),
            ).fetchone()  # fmt: skip
        return row["last"] if row["first"] is None else row["first"] - 1

    def queued_seqs(self, through_seq: int | None = None, adapter: str | None = None) -> list[tuple[int, str]]:
        with self._lock:
            rows = self._execute(
                "SELECT seq, kind FROM feedback WHERE state = 'queued' AND released_s IS NULL AND seq <= %s "
                "AND adapter IS NOT DISTINCT FROM %s ORDER BY seq",
                (through_seq if through_seq is not None else 2**62, adapter),
            ).fetchall()
        return [(r["seq"], r["kind"]) for r in rows]

    def read(self, after_seq: int = 0, limit: int = 100, state: str | None = None) -> list[FeedbackEntry]:
        if limit < 1:
            raise ValueError(f"limit must be positive (got {limit})")
        where = "seq > %s" + ("" if state is None else " AND state = %s")
        args = (after_seq,) + (() if state is None else (state,))
        return self._all(f"SELECT * FROM feedback WHERE {where} ORDER BY seq LIMIT %s", (*args, limit))

    def last_seq(self) -> int:
        with self._lock:
            return self._execute("SELECT COALESCE(MAX(seq), 0) AS last FROM feedback").fetchone()["last"]

    def counts(self, by: str) -> dict[str, int]:
        if by not in _COUNTED:
            raise ValueError(f"counts are by 'kind' or 'state' (got {by!r})")
        with self._lock:  # ``by`` is one of two column names, never the caller's text
            rows = self._execute(f"SELECT {by} AS value, COUNT(*) AS n FROM feedback GROUP BY {by}").fetchall()
        return {value: 0 for value in _COUNTED[by]} | {r["value"]: r["n"] for r in rows}

    def backlog(self) -> dict[str, tuple[int, float | None]]:
        with self._lock:
            rows = self._execute(
                f"SELECT {CLASS} AS cls, COUNT(*) AS n, MIN(created_s) AS oldest FROM feedback WHERE state = 'queued' "
                "GROUP BY 1"
            ).fetchall()
        return {c: (0, None) for c in CLASSES} | {r["cls"]: (r["n"], r["oldest"]) for r in rows}

    def backlog_by_adapter(self) -> dict[str | None, int]:
        with self._lock:
            rows = self._execute("SELECT adapter, COUNT(*) AS n FROM feedback WHERE state = 'queued' GROUP BY 1")
            return {r["adapter"]: r["n"] for r in rows.fetchall()}

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
            "SELECT * FROM feedback WHERE state = 'trained' AND correction IS NOT NULL AND seq > %s AND seq < %s "
            f"AND adapter IS NOT DISTINCT FROM %s ORDER BY seq{' DESC' if newest_first else ''} LIMIT %s",
            (after_seq, before_seq if before_seq is not None else 2**62, adapter, limit),
        )

    def ratings(self, adapter: str | None = None) -> dict[tuple[int, str | None], tuple[int, int]]:
        with self._lock:
            rows = self._execute(
                "SELECT adapter_version, key_name, COUNT(*) FILTER (WHERE rating = 1) AS up, "
                "COUNT(*) FILTER (WHERE rating = -1) AS down FROM feedback WHERE rating IS NOT NULL "
                "AND adapter IS NOT DISTINCT FROM %s GROUP BY 1, 2", (adapter,),
            ).fetchall()  # fmt: skip
        return {(r["adapter_version"], r["key_name"]): (r["up"], r["down"]) for r in rows}

    def _one(self, query: str, args: tuple) -> FeedbackEntry | None:
        with self._lock:
            row = self._execute(query, args).fetchone()
        return None if row is None else entry_from_row(row)

    def _all(self, query: str, args: tuple) -> list[FeedbackEntry]:
        with self._lock:
            rows = self._execute(query, args).fetchall()
        return [entry_from_row(r) for r in rows]

    def _settle(self, seqs: Sequence[int], assignment: str, args: tuple) -> int:
        if not seqs:
            return 0
        query = f"UPDATE feedback SET {assignment}, settled_s = %s WHERE state = 'queued' AND seq = ANY(%s)"
        with self._lock:  # one statement: its own transaction, durable (synchronous_commit) when it returns
            return self._execute(query, (*args, time.time(), [int(s) for s in seqs])).rowcount

