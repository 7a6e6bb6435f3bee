"""The feedback log on real SQLite files: durable appends (across processes, through SIGKILL), idempotency,
reads by position, counts and listeners."""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from alchemist.feedback.log import FeedbackEntry, FeedbackLog

REPO_ROOT = Path(__file__).resolve().parents[2]


def submission(response_id: str = "chatcmpl-1", **overrides) -> dict:
    fields = dict(
        response_id=response_id,
        kind="sft",
        rating=1,
        prompt_token_ids=[1, 2, 3],
        response_token_ids=[4, 5, 2],
        output_token_ids=[4, 5, 2],
        adapter_version=3,
        recorded=True,
    )
    return fields | overrides


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60
    )


@pytest.fixture
def log(tmp_path: Path):
    log = FeedbackLog(tmp_path / "data" / "feedback.sqlite")  # the directory does not exist yet
    yield log
    log.close()


def test_wal_mode_and_full_sync(log: FeedbackLog):
    log.append(**submission())
    assert log.path.with_name(log.path.name + "-wal").exists()
    with sqlite3.connect(log.path) as other:  # WAL is a property of the file, seen by every connection
        assert other.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert log._conn.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL: fsync on every commit


def test_append_then_read_back(log: FeedbackLog):
    assert log.last_seq() == 0 and log.read() == []
    first, created = log.append(**submission(correction="Better.", response_token_ids=[7, 8, 2]))
    assert created and first.seq == 1
    second, _ = log.append(**submission("chatcmpl-2", kind="negative", rating=-1, recorded=False))
    pref, _ = log.append(
        **submission("chatcmpl-3", kind="preference", rating=None, preferred_over="chatcmpl-4", rejected_token_ids=[9])
    )
    assert [e.seq for e in log.read()] == [1, 2, 3] and log.last_seq() == 3
    assert log.read(after_seq=1, limit=1) == [second]
    assert log.read(after_seq=3) == []
    entry = log.read()[0]
    assert entry == first
    assert (entry.response_id, entry.kind, entry.rating, entry.correction) == ("chatcmpl-1", "sft", 1, "Better.")
    assert (entry.prompt_token_ids, entry.response_token_ids, entry.output_token_ids) == (
        [1, 2, 3],
        [7, 8, 2],
        [4, 5, 2],
    )
    assert (entry.adapter_version, entry.recorded, entry.preferred_over, entry.rejected_token_ids) == (
        3,
        True,
        None,
        None,
    )
    assert (pref.preferred_over, pref.rejected_token_ids, pref.rating) == ("chatcmpl-4", [9], None)
    assert second.recorded is False and second.rating == -1


def test_large_token_ids_round_trip(log: FeedbackLog):
    ids = list(range(0, 2**31 - 1, 2**24)) + [2**31 - 1]
    entry, _ = log.append(**submission(prompt_token_ids=ids))
    assert log.read()[0].prompt_token_ids == ids == entry.prompt_token_ids


def test_the_same_submission_is_written_once(log: FeedbackLog):
    first, created = log.append(**submission())
    again, created_again = log.append(**submission(adapter_version=9))  # same user input, later state: same entry
    assert created and not created_again
    assert again == first and log.last_seq() == 1
    other, created_other = log.append(**submission(rating=-1, kind="negative"))  # a different submission
    assert created_other and other.seq == 2
    assert log.find(first.idempotency_key) == first and log.find("nope") is None


def test_counts_by_kind(log: FeedbackLog):
    assert log.counts() == {"sft": 0, "negative": 0, "preference": 0}
    log.append(**submission("a"))
    log.append(**submission("b", correction="x"))
    log.append(**submission("c", kind="negative", rating=-1))
    log.append(**submission("c", kind="negative", rating=-1))  # a repeat
    assert log.counts() == {"sft": 2, "negative": 1, "preference": 0}


def test_listeners_hear_each_new_entry_once(log: FeedbackLog):
    heard: list[FeedbackEntry] = []
    log.add_listener(heard.append)
    log.add_listener(lambda entry: 1 / 0)  # a failing listener: logged, the append still succeeds
    first, _ = log.append(**submission("a"))
    log.append(**submission("a"))
    second, _ = log.append(**submission("b"))
    assert heard == [first, second]


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"kind": "dpo"}, "kind"),
        ({"rating": 0}, "rating"),
        ({"rating": True}, "rating"),
        ({"kind": "preference"}, "rejected_token_ids"),  # a preference needs the worse output
        ({"rejected_token_ids": [1]}, "rejected_token_ids"),  # ... and only a preference has one
    ],
)
def test_bad_entries_are_refused_and_nothing_is_written(log: FeedbackLog, overrides: dict, field: str):
    with pytest.raises(ValueError, match=field):
        log.append(**submission(**overrides))
    assert log.last_seq() == 0


def test_concurrent_appends_get_distinct_consecutive_seqs(log: FeedbackLog):
    def append_many(thread: int) -> None:
        for i in range(20):
            log.append(**submission(f"r-{thread}-{i}"))

    threads = [threading.Thread(target=append_many, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [e.seq for e in log.read(limit=1000)] == list(range(1, 81))


def test_a_fresh_process_reads_what_another_wrote(log: FeedbackLog):
    entry, _ = log.append(**submission(correction="Fixed."))
    result = run_python(f"""
        import json
        from alchemist.feedback.log import FeedbackLog
        log = FeedbackLog({str(log.path)!r})
        print(json.dumps([e.__dict__ for e in log.read()]))
        log.append(response_id="from-child", kind="negative", rating=-1, prompt_token_ids=[1],
                   response_token_ids=[2], output_token_ids=[2], adapter_version=0, recorded=False)
    """)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == [entry.__dict__]
    assert [e.response_id for e in log.read()] == ["chatcmpl-1", "from-child"]  # and the other way round


def test_an_append_survives_sigkill_right_after_it_returns(tmp_path: Path):
    path = tmp_path / "feedback.sqlite"
    result = run_python(f"""
        import os, signal
        from alchemist.feedback.log import FeedbackLog
        log = FeedbackLog({str(path)!r})
        entry, created = log.append(response_id="killed", kind="sft", rating=1, prompt_token_ids=[1, 2],
                                    response_token_ids=[3, 2], output_token_ids=[3, 2], adapter_version=1,
                                    recorded=True)
        assert created
        os.kill(os.getpid(), signal.SIGKILL)  # no close, no checkpoint, no atexit
    """)
    assert result.returncode == -signal.SIGKILL, result.stderr
    log = FeedbackLog(path)
    try:
        [entry] = log.read()
        assert (entry.seq, entry.response_id, entry.response_token_ids) == (1, "killed", [3, 2])
    finally:
        log.close()
