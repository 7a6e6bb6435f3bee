"""The feedback log: every accepted piece of user feedback, append-only, in one SQLite file.

    log = FeedbackLog("alchemist-data/feedback.sqlite")
    entry, created = log.append(response_id="chatcmpl-...", kind="sft", rating=1, prompt_token_ids=[...], ...)
    new = log.read(after_seq=trainer_position, limit=64)      # the trainer's position is the last seq it consumed

Each entry gets an increasing sequence number ``seq`` (never reused), so a consumer's position in the log is one
integer it can checkpoint. The database runs in WAL mode with ``synchronous=FULL``: ``append`` returns only after
the row is on disk, so feedback the server acknowledged survives a crash or SIGKILL right after. An entry's
idempotency key (a hash of what the user sent) is unique: sending the same feedback again returns the existing
entry and writes nothing. Token ids are stored as little-endian int32 blobs.

What became of an entry is in the log too (``state``): "queued" until the trainer settles it, then "trained"
(with the adapter version of the step) or "skipped" (with the reason), or "quarantined": held out by the poisoning
guard (``alchemist.training.quarantine``) until an admin releases it, which makes it "queued" again, first in
line. The table and its migrations: ``alchemist.feedback.schema``.

Kinds: "sft" (learn ``response_token_ids``: the served output, or the user's correction), "negative" (a rating of
-1 without a correction: the served output was bad), "preference" (``response_id``'s output was preferred over
``preferred_over``'s, whose output is ``rejected_token_ids``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from alchemist.feedback.schema import STATES, migrate

logger = logging.getLogger(__name__)

KINDS = ("sft", "negative", "preference")
RATINGS = (1, -1)
# What people gave, as the backlog shows it and the trainer orders it: a correction, a rating, a preference.
CLASSES = ("correction", "thumbs_up", "thumbs_down", "preference")
CLASS = """(CASE WHEN correction IS NOT NULL THEN 'correction' WHEN kind = 'preference' THEN 'preference'
    WHEN rating = -1 THEN 'thumbs_down' ELSE 'thumbs_up' END)"""

_INSERTED = (  # the columns append() binds, in its order (the state's defaults apply)
    "idempotency_key", "response_id", "kind", "rating", "correction", "preferred_over", "prompt_token_ids",
    "response_token_ids", "output_token_ids", "rejected_token_ids", "adapter_version", "recorded", "created_s",
    "comment", "feedback_id", "metadata", "key_name",
)  # fmt: skip
_INSERT = f"INSERT INTO feedback ({', '.join(_INSERTED)}) VALUES ({', '.join('?' * len(_INSERTED))})"


@dataclass(frozen=True)
class FeedbackEntry:
    seq: int  # position in the log, from 1
    idempotency_key: str
    response_id: str  # the response the feedback is about; also the id of its activation record, if recorded
    kind: str  # "sft" | "negative" | "preference"
    rating: int | None  # 1, -1 or None
    correction: str | None
    preferred_over: str | None  # a response to the same prompt that was worse than response_id's
    prompt_token_ids: list[int]
    response_token_ids: list[int]  # what to train on: the served output ids, or the tokenized correction
    output_token_ids: list[int]  # what was served
    rejected_token_ids: list[int] | None  # preferred_over's served output ids ("preference" only)
    adapter_version: int  # the adapter the response was served with; 0 = the base model
    recorded: bool  # whether the prompt's activations were recorded (record id = response_id)
    created_s: float  # wall-clock time of the append
    comment: str | None = None  # the user's words about the response: kept and shown, never trained on
    feedback_id: str | None = None  # the client's own id for the submission (its idempotency key then)
    metadata: dict[str, Any] | None = None  # the client's JSON object, as sent
    state: str = "queued"  # "queued" | "trained" | "skipped" | "quarantined"
    trained_version: int | None = None  # the adapter version whose step trained it ("trained" only)
    skip_reason: str | None = None  # why it will not be trained ("skipped" only)
    settled_s: float | None = None  # when it left "queued"
    quarantine_reason: str | None = None  # why the poisoning guard held it (kept once released)
    quarantine_loss: float | None = None  # its loss then (None for NaN)
    quarantined_s: float | None = None
    released_s: float | None = None  # when an admin released it (it trains next, unchecked)
    key_name: str | None = None  # the API key that gave it (None: no keys, or logged before keys were kept)


def idempotency_key(
    response_id: str,
    rating: int | None,
    correction: str | None,
    preferred_over: str | None,
    comment: str | None = None,
    metadata: dict[str, Any] | None = None,
    feedback_id: str | None = None,
) -> str:
    """Equal for equal submissions: a retried POST finds the entry its first attempt wrote. With the client's
    ``feedback_id``, that id alone (the client says what is the same submission); without comment and metadata,
    the key of schema version 1 (a retry of feedback logged before them still finds its entry)."""
    if feedback_id is not None:
        fields: list[Any] = ["feedback_id", feedback_id]
    else:
        fields = [response_id, rating, correction, preferred_over]
        if comment is not None or metadata is not None:
            fields += [comment, metadata]
    payload = json.dumps(fields, ensure_ascii=False, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()


def encode_ids(ids: Sequence[int]) -> bytes:
    return np.asarray(ids, dtype="<i4").tobytes()


def decode_ids(blob: bytes) -> list[int]:
    return np.frombuffer(blob, dtype="<i4").tolist()


class FeedbackLog:
    """Thread-safe: one connection behind a lock (HTTP threads append, the trainer reads)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # isolation_level=None: no implicit transactions; append() opens and commits its own.
        self._conn = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._conn.row_factory = sqlite3.Row
        self._lock = threading.Lock()
        self._listeners: list[Callable[[FeedbackEntry], None]] = []
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
    ) -> tuple[FeedbackEntry, bool]:
        """Writes an entry (durably) unless one with the same submission exists; returns (entry, created)."""
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)} (got {kind!r})")
        if rating is not None and (isinstance(rating, bool) or rating not in RATINGS):
            raise ValueError(f"rating must be 1, -1 or None (got {rating!r})")
        if (kind == "preference") != (rejected_token_ids is not None):
            raise ValueError("rejected_token_ids must be given for kind 'preference' and only then")
        if metadata is not None and not isinstance(metadata, dict):
            raise ValueError(f"metadata must be a JSON object (got {type(metadata).__name__})")
        key = idempotency_key(response_id, rating, correction, preferred_over, comment, metadata, feedback_id)
        row = (
            key,
            response_id,
            kind,
            rating,
            correction,
            preferred_over,
            encode_ids(prompt_token_ids),
            encode_ids(response_token_ids),
            encode_ids(output_token_ids),
            None if rejected_token_ids is None else encode_ids(rejected_token_ids),
            int(adapter_version),
            int(bool(recorded)),
            time.time(),
            comment,
            feedback_id,
            None if metadata is None else json.dumps(metadata, ensure_ascii=False),
            key_name,
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
            self._notify(entry)  # after the commit, outside the lock: a listener may read the log
        return entry, created

    def find(self, key: str) -> FeedbackEntry | None:
        """The entry with idempotency key ``key``, if any."""
        with self._lock:
            return self._find(key)

    def get(self, seq: int) -> FeedbackEntry | None:
        """The entry at ``seq``, if any."""
        return self._one("SELECT * FROM feedback WHERE seq = ?", (seq,))

    def find_feedback_id(self, feedback_id: str) -> FeedbackEntry | None:
        """The entry a client submitted with its ``feedback_id``, if any."""
        return self._one("SELECT * FROM feedback WHERE feedback_id = ?", (feedback_id,))

    def mark_trained(self, seqs: Sequence[int], version: int | None) -> int:
        """The queued entries among ``seqs`` were trained by the step that made adapter ``version`` (None: a version
        no longer known); returns how many changed (an entry already settled keeps its state: settling is
        idempotent)."""
        return self._settle(seqs, "state = 'trained', trained_version = ?", (version,))

    def mark_skipped(self, seqs: Sequence[int], reason: str) -> int:
        """The queued entries among ``seqs`` will not be trained, for ``reason``; returns how many changed."""
        if not reason:
            raise ValueError("a skipped entry needs its reason")
        return self._settle(seqs, "state = 'skipped', skip_reason = ?", (reason,))

    def mark_quarantined(self, seq: int, reason: str, loss: float) -> bool:
        """The queued entry ``seq`` is held out of training by the poisoning guard, for ``reason``; False if it was
        not queued."""
        assignment = "state = 'quarantined', quarantine_reason = ?, quarantine_loss = ?, quarantined_s = ?"
        return self._settle([seq], assignment, (reason, loss, time.time())) == 1

    def release(self, seqs: Sequence[int]) -> list[int]:
        """The quarantined entries among ``seqs`` are queued again (first in line, see ``next_queued``); returns
        their seqs."""
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

    def quarantined(self) -> list[FeedbackEntry]:
        """The entries held by the poisoning guard, and those released but not trained yet, oldest first."""
        with self._lock:
            rows = self._conn.execute(
                "SELECT * FROM feedback WHERE state = 'quarantined' OR (state = 'queued' AND released_s IS NOT NULL) "
                "ORDER BY seq"
            ).fetchall()
        return [_entry(r) for r in rows]

    def next_queued(self, limit: int, per_key: int | None = None) -> list[FeedbackEntry]:
        """Up to ``limit`` queued entries in training order: released ones first (an admin is waiting for them),
        then corrections, then the rest, oldest first. With ``per_key``, each key's first ``per_key`` entries in
        that order come before any key's further ones (which fill what the others leave free), so one key takes at
        most ``per_key`` places while others' feedback waits (entries without a key count as one key)."""
        order = f"released_s IS NULL, {CLASS} != 'correction', seq"
        with self._lock:
            rows = self._conn.execute(
                f"SELECT * FROM (SELECT *, ROW_NUMBER() OVER (PARTITION BY COALESCE(key_name, '') ORDER BY {order}) "
                f"AS nth FROM feedback WHERE state = 'queued') ORDER BY nth > ?, {order} LIMIT ?",
                (per_key if per_key is not None else limit, limit),
            ).fetchall()
        return [_entry(r) for r in rows]

    def trained_corrections(self, limit: int, undone: Sequence[Sequence[int]] = ()) -> list[FeedbackEntry]:
        """The ``limit`` corrections trained most recently (the facts people taught), newest first, none trained by a
        version in one of the ``undone`` ranges (``trained_corrections_after``)."""
        skip, bounds = _not_undone(undone)
        with self._lock:
            rows = self._conn.execute(
                f"SELECT * FROM feedback WHERE state = 'trained' AND correction IS NOT NULL{skip} "
                "ORDER BY seq DESC LIMIT ?", (*bounds, limit),
            ).fetchall()  # fmt: skip
        return [_entry(r) for r in rows]

    def trained_corrections_after(
        self, after_seq: int, limit: int, undone: Sequence[Sequence[int]] = ()
    ) -> list[FeedbackEntry]:
        """Up to ``limit`` trained corrections with seq > ``after_seq``, oldest first, none trained by a version in
        one of the ``undone`` ranges ([lo, hi]: lo < version <= hi; what a rollback undid). Rehearsal takes them in
        turn."""
        skip, bounds = _not_undone(undone)
        with self._lock:
            rows = self._conn.execute(
                f"SELECT * FROM feedback WHERE state = 'trained' AND correction IS NOT NULL AND seq > ?{skip} "
                "ORDER BY seq LIMIT ?", (after_seq, *bounds, limit),
            ).fetchall()  # fmt: skip
        return [_entry(r) for r in rows]

    def entries(self, state: str | None = None, after_seq: int = 0, limit: int = 100) -> list[FeedbackEntry]:
        """Up to ``limit`` entries (in ``state``, if given) with seq > ``after_seq``, oldest first."""
        where = "seq > ?" + ("" if state is None else " AND state = ?")
        args = (after_seq,) + (() if state is None else (state,))
        with self._lock:
            rows = self._conn.execute(f"SELECT * FROM feedback WHERE {where} ORDER BY seq LIMIT ?", (*args, limit))
            return [_entry(r) for r in rows.fetchall()]

    def backlog(self) -> dict[str, tuple[int, float | None]]:
        """Queued entries by class ("correction", "thumbs_up", "thumbs_down", "preference"): (count, the oldest's
        created_s or None), every class present."""
        with self._lock:
            rows = self._conn.execute(
                f"SELECT {CLASS}, COUNT(*), MIN(created_s) FROM feedback WHERE state = 'queued' GROUP BY 1"
            ).fetchall()
        return {c: (0, None) for c in CLASSES} | {c: (n, oldest) for c, n, oldest in rows}

    def ratings_by_version(self, per_key: int | None = None) -> dict[int, tuple[int, int]]:
        """(thumbs up, thumbs down) the responses of each adapter version earned. One named key counts for at most
        ``per_key`` of a version's ratings (its own split kept), so that one user cannot decide alone how a version
        is judged; entries without a key (a server without keys is loopback-only) count in full."""
        with self._lock:
            rows = self._conn.execute(
                "SELECT adapter_version, key_name, SUM(rating = 1), SUM(rating = -1) FROM feedback "
                "WHERE rating IS NOT NULL GROUP BY 1, 2"
            ).fetchall()
        totals: dict[int, tuple[int, int]] = {}
        for version, key, up, down in rows:
            if key is not None and per_key is not None and up + down > per_key:
                up = round(up * per_key / (up + down))
                up, down = up, per_key - up
            before = totals.get(version, (0, 0))
            totals[version] = (before[0] + up, before[1] + down)
        return totals

    def state_counts(self) -> dict[str, int]:
        """Entries per state (every state present, 0 when none)."""
        with self._lock:
            rows = self._conn.execute("SELECT state, COUNT(*) FROM feedback GROUP BY state").fetchall()
        return {state: 0 for state in STATES} | dict(rows)

    def skip_queued_before(self, classes: Sequence[str], created_before_s: float, reason: str) -> int:
        """Marks skipped, for ``reason``, the queued entries of ``classes`` that arrived (or were released from
        quarantine) before ``created_before_s``; returns how many."""
        if not classes:
            return 0
        marks = ", ".join("?" * len(classes))
        with self._lock:
            return self._conn.execute(
                f"UPDATE feedback SET state = 'skipped', skip_reason = ?, settled_s = ? "
                f"WHERE state = 'queued' AND COALESCE(released_s, created_s) < ? AND {CLASS} IN ({marks})",
                (reason, time.time(), created_before_s, *classes),
            ).rowcount

    def oldest_queued(self, cls: str, excluding: Sequence[int] = ()) -> float | None:
        """When the longest-waiting queued entry of class ``cls`` (``CLASSES``) not among the seqs ``excluding``
        arrived (or was released from quarantine), as created_s; None if there is none."""
        marks = ", ".join("?" * len(excluding))
        with self._lock:
            return self._conn.execute(
                f"SELECT MIN(COALESCE(released_s, created_s)) FROM feedback WHERE state = 'queued' AND {CLASS} = ? "
                f"AND seq NOT IN ({marks})", (cls, *excluding),
            ).fetchone()[0]  # fmt: skip

    def settled_through(self, excluding: Sequence[int] = ()) -> int:
        """The largest seq up to which every entry is settled (trained, skipped, or quarantined: held for now; a
        released one trains later, first in line, however far the position moved) or among ``excluding``."""
        marks = ", ".join("?" * len(excluding))
        with self._lock:  # one read transaction: an append in between cannot slip under the answer
            self._conn.execute("BEGIN")
            try:
                last = self._conn.execute("SELECT COALESCE(MAX(seq), 0) FROM feedback").fetchone()[0]
                first = self._conn.execute(
                    f"SELECT MIN(seq) FROM feedback WHERE state = 'queued' AND seq NOT IN ({marks})", tuple(excluding)
                ).fetchone()[0]
            finally:
                self._conn.execute("COMMIT")
        return last if first is None else first - 1

    def queued_seqs(self, through_seq: int | None = None) -> list[tuple[int, str]]:
        """(seq, kind) of the queued entries (with seq <= ``through_seq``), oldest first; not those released from
        quarantine (queued behind the position on purpose)."""
        with self._lock:
            rows = self._conn.execute(
                "SELECT seq, kind FROM feedback WHERE state = 'queued' AND released_s IS NULL AND seq <= ? "
                "ORDER BY seq",
                (through_seq if through_seq is not None else 2**62,),
            ).fetchall()
        return [(seq, kind) for seq, kind in rows]

    def read(self, after_seq: int = 0, limit: int = 100) -> list[FeedbackEntry]:
        """Up to ``limit`` entries with seq > ``after_seq``, oldest first."""
        if limit < 1:
            raise ValueError(f"limit must be positive (got {limit})")
        with self._lock:
            rows = self._conn.execute(
                "SELECT * FROM feedback WHERE seq > ? ORDER BY seq LIMIT ?", (after_seq, limit)
            ).fetchall()
        return [_entry(r) for r in rows]

    def last_seq(self) -> int:
        """The newest entry's seq; 0 for an empty log."""
        with self._lock:
            return self._conn.execute("SELECT COALESCE(MAX(seq), 0) FROM feedback").fetchone()[0]

    def counts(self) -> dict[str, int]:
        """Entries per kind (every kind present, 0 when none)."""
        with self._lock:
            rows = self._conn.execute("SELECT kind, COUNT(*) FROM feedback GROUP BY kind").fetchall()
        return {kind: 0 for kind in KINDS} | dict(rows)

    def add_listener(self, callback: Callable[[FeedbackEntry], None]) -> None:
        """``callback(entry)`` runs after each new entry is committed, in the appending thread (keep it short:
        the HTTP response waits for it). Duplicates do not call it."""
        self._listeners.append(callback)

    def close(self) -> None:
        with self._lock:
            self._conn.close()  # the last connection to close checkpoints the WAL into the main file

    def _one(self, query: str, args: tuple) -> FeedbackEntry | None:
        with self._lock:
            row = self._conn.execute(query, args).fetchone()
        return None if row is None else _entry(row)

    def _settle(self, seqs: Sequence[int], assignment: str, args: tuple) -> int:
        if not seqs:
            return 0
        marks = ", ".join("?" * len(seqs))
        query = f"UPDATE feedback SET {assignment}, settled_s = ? WHERE state = 'queued' AND seq IN ({marks})"
        with self._lock:  # one statement: its own transaction, durable (synchronous=FULL) when it returns
            return self._conn.execute(query, (*args, time.time(), *map(int, seqs))).rowcount

    def _find(self, key: str) -> FeedbackEntry | None:
        row = self._conn.execute("SELECT * FROM feedback WHERE idempotency_key = ?", (key,)).fetchone()
        return None if row is None else _entry(row)

    def _notify(self, entry: FeedbackEntry) -> None:
        for callback in list(self._listeners):
            try:
                callback(entry)
            except Exception:  # the entry is committed: a failing listener must not turn the append into an error
                logger.exception("feedback listener %r failed on entry %d", callback, entry.seq)


def _not_undone(undone: Sequence[Sequence[int]]) -> tuple[str, list[int]]:
    """A WHERE clause's tail (and its arguments) leaving out entries trained by a version in one of the ``undone``
    ranges ([lo, hi]: lo < version <= hi)."""
    skip = " AND NOT (COALESCE(trained_version, 0) > ? AND COALESCE(trained_version, 0) <= ?)" * len(undone)
    return skip, [bound for lo_hi in undone for bound in lo_hi]


def _entry(row: sqlite3.Row) -> FeedbackEntry:
    rejected = row["rejected_token_ids"]
    return FeedbackEntry(
        seq=row["seq"],
        idempotency_key=row["idempotency_key"],
        response_id=row["response_id"],
        kind=row["kind"],
        rating=row["rating"],
        correction=row["correction"],
        preferred_over=row["preferred_over"],
        prompt_token_ids=decode_ids(row["prompt_token_ids"]),
        response_token_ids=decode_ids(row["response_token_ids"]),
        output_token_ids=decode_ids(row["output_token_ids"]),
        rejected_token_ids=None if rejected is None else decode_ids(rejected),
        adapter_version=row["adapter_version"],
        recorded=bool(row["recorded"]),
        created_s=row["created_s"],
        comment=row["comment"],
        feedback_id=row["feedback_id"],
        metadata=None if row["metadata"] is None else json.loads(row["metadata"]),
        state=row["state"],
        trained_version=row["trained_version"],
        skip_reason=row["skip_reason"],
        settled_s=row["settled_s"],
        quarantine_reason=row["quarantine_reason"],
        quarantine_loss=row["quarantine_loss"],
        quarantined_s=row["quarantined_s"],
        released_s=row["released_s"],
        key_name=row["key_name"],
    )
