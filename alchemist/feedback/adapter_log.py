"""One named adapter's view of the feedback log: the log as that adapter's trainer reads it.

    log = AdapterLog(shared_log, "team-a")
    trainer = OnlineTrainer.from_config(..., log, ...)     # its queue, position and history are team-a's alone

Every entry names the adapter that served its response (``FeedbackEntry.adapter``; None: the shared adapter), and
the trainer's reads take an ``adapter`` (``alchemist.feedback.log``). This view fills it in, so that the online
trainer's parts (its queue, lineage, rehearsal, stopping, regression watch), written for one adapter, read a named
adapter's entries without a word about names: its batches never hold another adapter's entries, its position
counts only its own, and its regression watch sees only its own versions' ratings. Everything else (appends,
lookups by seq, settling by seq, the listeners) is the log's own, shared by every adapter.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from alchemist.feedback.log import FeedbackEntry, FeedbackLog


class AdapterLog:
    """``log`` (a ``FeedbackLog``) as adapter ``adapter``'s trainer reads it; a ``FeedbackLog`` itself."""

    def __init__(self, log: FeedbackLog, adapter: str) -> None:
        self.log = log
        self.adapter = adapter

    def __getattr__(self, name: str) -> Any:
        # What no adapter scopes (append, get, find, mark_*, release, read, counts, backlog, ...): the log's own.
        return getattr(self.log, name)

    def next_queued(self, limit: int, per_key: int | None = None, own: str | None = None) -> list[FeedbackEntry]:
        return self.log.next_queued(limit, per_key, own, adapter=self.adapter)

    def skip_queued_before(self, classes: Sequence[str], created_before_s: float, reason: str) -> int:
        return self.log.skip_queued_before(classes, created_before_s, reason, adapter=self.adapter)

    def oldest_queued(self, cls: str, excluding: Sequence[int] = ()) -> float | None:
        return self.log.oldest_queued(cls, excluding, adapter=self.adapter)

    def settled_through(self, excluding: Sequence[int] = ()) -> int:
        return self.log.settled_through(excluding, adapter=self.adapter)

    def queued_seqs(self, through_seq: int | None = None) -> list[tuple[int, str]]:
        return self.log.queued_seqs(through_seq, adapter=self.adapter)

    def trained_corrections(
        self, limit: int, after_seq: int = 0, before_seq: int | None = None, newest_first: bool = False
    ) -> list[FeedbackEntry]:
        return self.log.trained_corrections(limit, after_seq, before_seq, newest_first, adapter=self.adapter)

    def ratings(self) -> dict[tuple[int, str | None], tuple[int, int]]:
        return self.log.ratings(adapter=self.adapter)
