"""What the serving adapter was taught: the feedback log's trained corrections, less those a rollback undid.

A rollback serves an older version again; the versions after it are undone, and the checkpoints keep their ranges
(``undone``: [lo, hi] for lo < version <= hi; a restart or a later rollback reads them back). The log knows only
which version trained an entry (``trained_version``); which versions still count is the trainer's knowledge, so it
is applied here, over what the log returns: the evaluation gate's taught facts (newest first), rehearsal (in turn,
oldest first) and the prompts routed to the corrections' ranks (``online.taught_prompts``) all read through it.
"""

from __future__ import annotations

from collections.abc import Sequence

from alchemist.feedback.log import FeedbackEntry, FeedbackLog

PAGE = 64  # corrections read at a time while undone ones are passed over


def is_undone(version: int | None, undone: Sequence[Sequence[int]]) -> bool:
    """Whether ``version`` lies in one of the ``undone`` ranges (None, a version no longer known, never does)."""
    v = version or 0
    return any(lo < v <= hi for lo, hi in undone)


def taught_corrections(
    log: FeedbackLog, limit: int, undone: Sequence[Sequence[int]], after_seq: int = 0, newest_first: bool = False
) -> list[FeedbackEntry]:
    """Up to ``limit`` trained corrections with seq > ``after_seq``, oldest first (or ``newest_first``), none
    trained by a version in one of the ``undone`` ranges. The log is read a page at a time until ``limit`` are
    found or it ends; without undone ranges that is one read of ``limit``."""
    taken: list[FeedbackEntry] = []
    lo, hi = after_seq, None  # the seqs still to read lie strictly between
    while len(taken) < limit:
        want = limit - len(taken)
        asked = max(want, PAGE) if undone else want
        page = log.trained_corrections(asked, after_seq=lo, before_seq=hi, newest_first=newest_first)
        taken += [e for e in page if not is_undone(e.trained_version, undone)]
        if len(page) < asked:
            break  # the log's end
        if newest_first:
            hi = page[-1].seq
        else:
            lo = page[-1].seq
    return taken[:limit]
