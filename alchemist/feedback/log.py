"""The feedback log: every accepted piece of user feedback, append-only. What it promises (``FeedbackLog``), the
entry (``FeedbackEntry``) and the pure helpers every backend shares; the one backend today is one SQLite file
(``alchemist.feedback.sqlite_log``).

    log = SQLiteFeedbackLog("alchemist-data/feedback.sqlite")
    entry, created = log.append(response_id="chatcmpl-...", kind="sft", rating=1, prompt_token_ids=[...], ...)
    new = log.read(after_seq=trainer_position, limit=64)      # the trainer's position is the last seq it consumed

Each entry gets an increasing sequence number ``seq`` (never reused), so a consumer's position in the log is one
integer it can checkpoint. Nothing acknowledged is lost: ``append`` returns only once the entry is durable (it
survives a crash or SIGKILL right after), and so does a change of state. An entry's idempotency key (a hash of what
the user sent, ``idempotency_key``) is unique: sending the same feedback again returns the existing entry and
writes nothing.

What became of an entry is in the log too (``state``): "queued" until the trainer settles it, then "trained"
(with the adapter version of the step) or "skipped" (with the reason), or "quarantined": held out by the poisoning
guard (``alchemist.training.quarantine``) until an admin releases it, which makes it "queued" again, first in
line. The log knows no training policy: what a rollback undid and how far one key's ratings count are the trainer's
(``alchemist.training.taught``, ``alchemist.training.regression``), over what the log returns.

Each entry names the adapter that served its response (``adapter``; None: the shared adapter): the one it trains.
Every adapter has its own queue, position and history, so the trainer's reads (``next_queued``, ``settled_through``,
``queued_seqs``, ``oldest_queued``, ``skip_queued_before``, ``trained_corrections``, ``ratings``) take an
``adapter`` and see only its entries; left out, the shared adapter's (``alchemist.feedback.adapter_log`` binds one
for a named adapter's trainer, whose code then reads the log as the shared trainer does).

Kinds: "sft" (learn ``response_token_ids``: the served output, or the user's correction), "negative" (a rating of
-1 without a correction: the served output was bad), "preference" (``response_id``'s output was preferred over
``preferred_over``'s, whose output is ``rejected_token_ids``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, Protocol, runtime_checkable

import numpy as np

logger = logging.getLogger(__name__)

KINDS = ("sft", "negative", "preference")
RATINGS = (1, -1)
STATES = ("queued", "trained", "skipped", "quarantined")
# What people gave, as the backlog shows it and the trainer orders it: a correction, a rating, a preference.
CLASSES = ("correction", "thumbs_up", "thumbs_down", "preference")


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
    adapter: str | None = None  # the named adapter that served the response, which it trains (None: the shared one)


@runtime_checkable
class FeedbackLog(Protocol):
    """The log as the server, the trainer and the dashboard use it. Thread-safe: HTTP threads append while the
    trainer reads and settles. Every ``limit`` is a count of entries; every order is by seq unless said."""

    # The write path.
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
        """Writes an entry (durably: it survives a crash once this returns) unless one with the same submission
        (``idempotency_key``) exists; returns (entry, created). A bad entry (``check_entry``) raises ValueError and
        writes nothing."""
        ...

    def add_listener(self, callback: Callable[[FeedbackEntry], None]) -> None:
        """``callback(entry)`` runs after each new entry is committed, in the appending thread (keep it short:
        the HTTP response waits for it). Duplicates do not call it; a failing callback does not fail the append."""
        ...

    def close(self) -> None:
        """Lets go of the storage (what was acknowledged is there already); the log is not used after."""
        ...

    # Lookups.
    def get(self, seq: int) -> FeedbackEntry | None:
        """The entry at ``seq``, if any."""
        ...

    def find(self, key: str | None = None, *, feedback_id: str | None = None) -> FeedbackEntry | None:
        """The entry with idempotency key ``key``, or the one a client submitted with its ``feedback_id`` (give
        one of the two), if any."""
        ...

    # The trainer's queue.
    def next_queued(
        self, limit: int, per_key: int | None = None, own: str | None = None, adapter: str | None = None
    ) -> list[FeedbackEntry]:
        """Up to ``limit`` queued entries of ``adapter`` (its own queue) in training order: released ones first (an
        admin is waiting for them), then corrections, then the rest; in each, with ``own``, the entries whose
        response id holds it first (a replica's own responses, whose records it holds:
        ``alchemist.scale.replica.id_tag``); oldest first. With ``per_key``, each key's first ``per_key`` entries in
        that order come before any key's further ones (which fill what the others leave free), so one key takes at
        most ``per_key`` places while others' feedback waits (entries without a key count as one key)."""
        ...

    def mark_trained(self, seqs: Sequence[int], version: int | None) -> int:
        """The queued entries among ``seqs`` were trained by the step that made adapter ``version`` (None: a version
        no longer known); returns how many changed (an entry already settled keeps its state: settling is
        idempotent). Durable when it returns, as every change of state."""
        ...

    def mark_skipped(self, seqs: Sequence[int], reason: str) -> int:
        """The queued entries among ``seqs`` will not be trained, for ``reason`` (required: ValueError without);
        returns how many changed."""
        ...

    def skip_queued_before(
        self, classes: Sequence[str], created_before_s: float, reason: str, adapter: str | None = None
    ) -> int:
        """Marks skipped, for ``reason``, ``adapter``'s queued entries of ``classes`` (``CLASSES``) that arrived (or
        were released from quarantine) before ``created_before_s``; returns how many."""
        ...

    def mark_quarantined(self, seq: int, reason: str, loss: float) -> bool:
        """The queued entry ``seq`` is held out of training by the poisoning guard, for ``reason`` (``loss``: its
        loss then; NaN is kept as None); False if it was not queued."""
        ...

    def release(self, seqs: Sequence[int]) -> list[int]:
        """The quarantined entries among ``seqs`` are queued again (first in line, see ``next_queued``); returns
        their seqs, sorted."""
        ...

    def oldest_queued(self, cls: str, excluding: Sequence[int] = (), adapter: str | None = None) -> float | None:
        """When ``adapter``'s longest-waiting queued entry of class ``cls`` (``CLASSES``) not among the seqs
        ``excluding`` arrived (or was released from quarantine), as created_s; None if there is none."""
        ...

    def settled_through(self, excluding: Sequence[int] = (), adapter: str | None = None) -> int:
        """The largest seq up to which every entry of ``adapter`` is settled (trained, skipped, or quarantined: held
        for now; a released one trains later, first in line, however far the position moved) or among ``excluding``; one
        consistent reading (an append in between cannot slip under the answer)."""
        ...

    def queued_seqs(self, through_seq: int | None = None, adapter: str | None = None) -> list[tuple[int, str]]:
        """(seq, kind) of ``adapter``'s queued entries (with seq <= ``through_seq``), oldest first; not those released
        from quarantine (queued behind the position on purpose)."""
        ...

    # Reads for the API, the metrics, the dashboard and the trainer.
    def read(self, after_seq: int = 0, limit: int = 100, state: str | None = None) -> list[FeedbackEntry]:
        """Up to ``limit`` (positive: ValueError otherwise) entries (in ``state``, if given) with seq >
        ``after_seq``, oldest first."""
        ...

    def last_seq(self) -> int:
        """The newest entry's seq; 0 for an empty log."""
        ...

    def counts(self, by: str) -> dict[str, int]:
        """Entries per "kind" or per "state" (``by``), every kind or state present (0 when none)."""
        ...

    def backlog(self) -> dict[str, tuple[int, float | None]]:
        """Queued entries by class (``CLASSES``): (count, the oldest's created_s or None), every class present; every
        adapter's together."""
        ...

    def backlog_by_adapter(self) -> dict[str | None, int]:
        """Queued entries per adapter (None: the shared one), only adapters with some."""
        ...

    def quarantined(self) -> list[FeedbackEntry]:
        """The entries held by the poisoning guard, and those released but not trained yet, oldest first."""
        ...

    def trained_corrections(
        self, limit: int, after_seq: int = 0, before_seq: int | None = None, newest_first: bool = False,
        adapter: str | None = None,
    ) -> list[FeedbackEntry]:  # fmt: skip
        """Up to ``limit`` of ``adapter``'s trained corrections (the facts people taught; with their
        ``trained_version``) with ``after_seq`` < seq < ``before_seq`` (None: no upper bound), oldest first or
        ``newest_first``."""
        ...

    def ratings(self, adapter: str | None = None) -> dict[tuple[int, str | None], tuple[int, int]]:
        """(thumbs up, thumbs down) of ``adapter``'s responses per (its version that served the response, key name
        that rated it)."""
        ...


def check_entry(kind: str, rating: int | None, rejected_token_ids: object, metadata: object) -> None:
    """What ``append`` refuses, with a ValueError naming the field."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)} (got {kind!r})")
    if rating is not None and (isinstance(rating, bool) or rating not in RATINGS):
        raise ValueError(f"rating must be 1, -1 or None (got {rating!r})")
    if (kind == "preference") != (rejected_token_ids is not None):
        raise ValueError("rejected_token_ids must be given for kind 'preference' and only then")
    if metadata is not None and not isinstance(metadata, dict):
        raise ValueError(f"metadata must be a JSON object (got {type(metadata).__name__})")


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
    """Token ids as stored: little-endian int32."""
    return np.asarray(ids, dtype="<i4").tobytes()


def decode_ids(blob: bytes) -> list[int]:
    return np.frombuffer(blob, dtype="<i4").tolist()


# The stored form, shared by the SQL backends (sqlite_log, postgres_log): the columns an append binds, in order (the
# state's defaults apply), and an entry's class (``CLASSES``) from its columns, in SQL both dialects read.
INSERTED = (
    "idempotency_key", "response_id", "kind", "rating", "correction", "preferred_over", "prompt_token_ids",
    "response_token_ids", "output_token_ids", "rejected_token_ids", "adapter_version", "recorded", "created_s",
    "comment", "feedback_id", "metadata", "key_name", "adapter",
)  # fmt: skip
CLASS = """(CASE WHEN correction IS NOT NULL THEN 'correction' WHEN kind = 'preference' THEN 'preference'
    WHEN rating = -1 THEN 'thumbs_down' ELSE 'thumbs_up' END)"""


def new_row(
    *,
    response_id: str,
    kind: str,
    prompt_token_ids: Sequence[int],
    response_token_ids: Sequence[int],
    output_token_ids: Sequence[int],
    adapter_version: int,
    recorded: bool,
    rating: int | None,
    correction: str | None,
    preferred_over: str | None,
    rejected_token_ids: Sequence[int] | None,
    comment: str | None,
    feedback_id: str | None,
    metadata: dict[str, Any] | None,
    key_name: str | None,
    adapter: str | None = None,
) -> tuple[str, tuple]:
    """An append's entry checked (``check_entry``): its idempotency key and its ``INSERTED`` values."""
    check_entry(kind, rating, rejected_token_ids, metadata)
    key = idempotency_key(response_id, rating, correction, preferred_over, comment, metadata, feedback_id)
    rejected = None if rejected_token_ids is None else encode_ids(rejected_token_ids)
    encoded = None if metadata is None else json.dumps(metadata, ensure_ascii=False)
    return key, (key, response_id, kind, rating, correction, preferred_over, encode_ids(prompt_token_ids),
                 encode_ids(response_token_ids), encode_ids(output_token_ids), rejected, int(adapter_version),
                 bool(recorded), time.time(), comment, feedback_id, encoded, key_name, adapter)  # fmt: skip


def entry_from_row(row: Mapping[str, Any]) -> FeedbackEntry:
    """A stored row (every column, by name) as the entry it holds."""
    values = {f.name: row[f.name] for f in fields(FeedbackEntry)}
    for name in ("prompt_token_ids", "response_token_ids", "output_token_ids", "rejected_token_ids"):
        values[name] = None if row[name] is None else decode_ids(row[name])
    values["metadata"] = None if row["metadata"] is None else json.loads(row["metadata"])
    values["recorded"] = bool(row["recorded"])  # SQLite stores it as 0 / 1
    return FeedbackEntry(**values)


class Listeners:
    """The callbacks of ``FeedbackLog.add_listener``, told of each new entry."""

    def __init__(self) -> None:
        self._callbacks: list[Callable[[FeedbackEntry], None]] = []

    def add(self, callback: Callable[[FeedbackEntry], None]) -> None:
        self._callbacks.append(callback)

    def notify(self, entry: FeedbackEntry) -> None:
        for callback in list(self._callbacks):
            try:
                callback(entry)
            except Exception:  # the entry is committed: a failing listener must not turn the append into an error
                logger.exception("feedback listener %r failed on entry %d", callback, entry.seq)
