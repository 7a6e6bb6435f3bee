"""What the serving adapter was taught (alchemist.training.taught): a real SQLite log's trained corrections, less
those a rollback undid; tests/training/test_online.py has rehearsal and the gate reading through it."""

from __future__ import annotations

from pathlib import Path

import pytest

from alchemist.feedback.sqlite_log import SQLiteFeedbackLog
from alchemist.training.taught import PAGE, is_undone, taught_corrections
from tests.feedback.test_log import submission


@pytest.fixture
def log(tmp_path: Path):
    log = SQLiteFeedbackLog(tmp_path / "feedback.sqlite")
    yield log
    log.close()


def test_trained_corrections_leave_out_what_a_rollback_undid(log: SQLiteFeedbackLog):
    """Both reads of taught corrections (the gate's, newest first; rehearsal's, oldest first after a seq) skip the
    entries trained by a version in an undone range (lo, hi]; ratings are never among them."""
    seqs = [log.append(**submission(f"r{i}", correction=f"Fact {i}."))[0].seq for i in range(5)]
    rating = log.append(**submission("thumb"))[0].seq
    for version, seq in enumerate(seqs, start=1):
        log.mark_trained([seq], version)
    log.mark_trained([rating], 5)
    assert [e.seq for e in taught_corrections(log, 10, [], newest_first=True)] == seqs[::-1]
    assert [e.seq for e in taught_corrections(log, 10, [[1, 3]], newest_first=True)] == [seqs[4], seqs[3], seqs[0]]
    assert [e.seq for e in taught_corrections(log, 2, [[1, 3], [3, 5]], newest_first=True)] == [seqs[0]]
    assert [e.seq for e in taught_corrections(log, 10, [[1, 3]], seqs[0])] == seqs[3:]
    assert taught_corrections(log, 10, [[0, 5]], newest_first=True) == []


def test_a_version_no_longer_known_is_never_undone():
    assert not is_undone(None, [[0, 5]]) and not is_undone(0, [[0, 5]])
    assert is_undone(1, [[0, 5]]) and is_undone(5, [[0, 5]]) and not is_undone(6, [[0, 5]])


def test_more_undone_than_a_page_is_read_past(log: SQLiteFeedbackLog):
    """A long undone run between the kept corrections: the reads go on, a page at a time, until ``limit`` are
    found, and take what one read of everything and a filter would."""
    seqs = [log.append(**submission(f"r{i}", correction=f"Fact {i}."))[0].seq for i in range(140)]
    for version in range(1, 15):  # ten corrections a version
        log.mark_trained(seqs[(version - 1) * 10 : version * 10], version)
    undone = [[2, 12]]  # versions 3..12: 100 corrections, more than a page
    assert 100 > PAGE
    newest = taught_corrections(log, 25, undone, newest_first=True)
    assert [e.seq for e in newest] == seqs[139:119:-1] + seqs[19:14:-1]
    oldest = taught_corrections(log, 25, undone, after_seq=seqs[4])
    assert [e.seq for e in oldest] == seqs[5:20] + seqs[120:130]
    for limit, after, newest_first in [(1, 0, True), (64, 0, False), (65, seqs[30], False), (200, 0, True)]:
        everything = log.trained_corrections(10**6, after_seq=after, newest_first=newest_first)
        expected = [e for e in everything if not is_undone(e.trained_version, undone)][:limit]
        assert taught_corrections(log, limit, undone, after, newest_first) == expected
