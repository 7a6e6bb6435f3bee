"""What the online trainer trains next: the log's queued feedback in training order, and the backlog policy.

Training order: corrections first (what someone took the time to write is what users check was learned), then
ratings and preferences, oldest first in each; one API key takes at most ``key_share`` of a batch while other keys'
feedback waits (a flood from one key neither crowds the others out nor makes a batch its own alone; its excess
trains in later batches). The queue is the log itself (entries whose state is "queued"), so a
restart, a failed batch or a rollback needs no bookkeeping here: what was not settled is simply queued still.

Every acknowledged entry ends settled: trained (the trainer marks its batch after the checkpoint), or skipped with
its reason, which this module gives in two cases: an entry with nothing to learn (an empty prompt or response), and
the backlog policy: when the trainer falls behind, a rating or preference still queued ``skip_ratings_after_s``
after it arrived is skipped (corrections after ``skip_corrections_after_s``, by default never), so that the
trainer spends its time on what is recent and the backlog stays bounded.

How feedback becomes a sample (``item``): a correction -> SFT on it; a rating without a correction -> KTO, desirable
for 1 (or SFT on the served answer, with ``thumbs_up="sft"``), undesirable for -1; a preference -> a DPO pair.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from alchemist.config.training import QueueConfig
from alchemist.feedback.log import FeedbackEntry, FeedbackLog
from alchemist.training.feedback_batch import Item

POLICY_EVERY_S = 1.0  # how often the backlog policy runs (and the queue is read again without a new append)
EMPTY = "nothing to learn: the prompt or a response is empty"


def item(entry: FeedbackEntry, thumbs_up: str = "kto") -> Item | None:
    """The training item of a log entry; None if it has nothing to learn."""
    prompt, record, seq = entry.prompt_token_ids, entry.response_id, entry.seq
    if not prompt or not entry.response_token_ids:
        return None
    if entry.kind == "preference":
        if not entry.rejected_token_ids:
            return None
        return Item("dpo", prompt, entry.response_token_ids, record, rejected_ids=entry.rejected_token_ids, seq=seq)
    if entry.kind == "negative":
        return Item("kto", prompt, entry.response_token_ids, record, desirable=False, seq=seq)
    if entry.correction is None and thumbs_up == "kto":
        return Item("kto", prompt, entry.response_token_ids, record, desirable=True, seq=seq)
    return Item("sft", prompt, entry.response_token_ids, record, seq=seq)


class FeedbackQueue:
    def __init__(
        self, log: FeedbackLog, config: QueueConfig, thumbs_up: str, on_new: Callable[[FeedbackEntry], None]
    ) -> None:
        self.log = log
        self.config = config
        self.thumbs_up = thumbs_up  # how a thumbs-up without a correction trains (ObjectivesConfig.thumbs_up)
        self.on_new = on_new  # told of each entry appended after ``seen`` (the anchors leave its prompt alone)
        self.seen = 0
        self.skipped: dict[str, int] = {}  # entries this queue skipped, by class of reason ("empty", "backlog")
        self.own: str | None = None  # a replica's: its responses' id tag, whose entries it trains first
        self._head: list[tuple[FeedbackEntry, Item]] = []  # the next entries in training order
        self._stale = True
        self._checked_s = 0.0
        log.add_listener(lambda entry: self.changed())

    def changed(self) -> None:
        """The queue must be read again (an append, a batch settled or dropped)."""
        self._stale = True

    def head(self) -> list[tuple[FeedbackEntry, Item]]:
        """Up to ``batch_size`` queued entries in training order, with their items; applies the backlog policy
        first (call it between batches only: it must not skip an entry of a batch in training)."""
        self._see_new()
        now = time.time()
        if now - self._checked_s >= POLICY_EVERY_S:
            self._checked_s = now
            self._apply_policy(now)
            self._stale = True
        while self._stale:
            self._stale = False
            head, empty = [], []
            for entry in self.log.next_queued(self.config.batch_size, self.config.per_key, self.own):
                it = item(entry, self.thumbs_up)
                if it is None:
                    empty.append(entry.seq)
                else:
                    head.append((entry, it))
            if empty:  # settled now, then read again: never a poison pill for the loop
                self._skip("empty", self.log.mark_skipped(empty, EMPTY))
                self._stale = True
            self._head = head
        return self._head

    def _see_new(self) -> None:
        for entry in self.log.read(after_seq=self.seen, limit=max(64, self.config.batch_size)):
            self.seen = entry.seq
            self.on_new(entry)

    def _apply_policy(self, now: float) -> None:
        c = self.config
        for classes, after_s, flag in (
            (("thumbs_up", "thumbs_down", "preference"), c.skip_ratings_after_s, "--train-skip-ratings-after-s"),
            (("correction",), c.skip_corrections_after_s, "--train-skip-corrections-after-s"),
        ):
            if after_s > 0:
                reason = f"not trained within {after_s:g} s of its arrival: the trainer was behind ({flag})"
                self._skip("backlog", self.log.skip_queued_before(classes, now - after_s, reason))

    def _skip(self, why: str, count: int) -> None:
        if count:
            self.skipped[why] = self.skipped.get(why, 0) + count
