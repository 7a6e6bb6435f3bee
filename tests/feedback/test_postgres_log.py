"""What only the PostgreSQL log has: several processes share it, so the trainer's queue is a claim (``next_queued``
claims what it returns for its log's owner: ``SELECT ... FOR UPDATE SKIP LOCKED``), claims end with their owner's
session, and the schema is made once however many connect at once. Each log here is its own connection and owner,
as a replica's process would be. The contract both logs share: tests/feedback/test_log.py."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable

import psycopg
import pytest

from alchemist.feedback.backends import open_feedback_log
from alchemist.feedback.postgres_log import PostgresFeedbackLog
from alchemist.feedback.postgres_schema import VERSION
from alchemist.feedback.sqlite_log import SQLiteFeedbackLog
from tests.feedback.test_log import REPO_ROOT, submission


@pytest.fixture
def logs(postgres_url: str):
    """Opens logs (owners) on one fresh database; closes them after the test."""
    opened: list[PostgresFeedbackLog] = []

    def open_log() -> PostgresFeedbackLog:
        opened.append(PostgresFeedbackLog(postgres_url))
        return opened[-1]

    yield open_log
    for log in opened:
        log.close()


def eventually(condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
    """Waits for what the server does on its own time (ending a closed session); not a measurement."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the server did not get there"
        time.sleep(0.05)


def seqs(entries) -> list[int]:
    return [e.seq for e in entries]


def claim_at_once(claimants: list[PostgresFeedbackLog], limit: int) -> list[list[int]]:
    """Each claimant's ``next_queued(limit)``, all started at the same moment, one thread each."""
    start = threading.Barrier(len(claimants))
    claims: list[list[int]] = [[] for _ in claimants]

    def claim(i: int) -> None:
        start.wait()
        claims[i] = seqs(claimants[i].next_queued(limit))

    threads = [threading.Thread(target=claim, args=(i,)) for i in range(len(claimants))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return claims


def test_concurrent_claimants_never_share_an_entry_and_together_take_all(logs):
    """Three owners claim at the same moment, round after round: no entry is in two claims, and every queued entry
    is in one (SKIP LOCKED passes a row another claimant locked, then the head is taken again without it)."""
    claimants = [logs() for _ in range(3)]
    for round_ in range(5):
        added = {claimants[0].append(**submission(f"r{round_}-{i}"))[0].seq for i in range(30)}
        claims = claim_at_once(claimants, 10)
        claimed = [seq for claim_ in claims for seq in claim_]
        assert len(claimed) == len(set(claimed)) == 30 and set(claimed) == added, claims
        for log, claim_ in zip(claimants, claims, strict=True):
            assert claim_ == sorted(claim_)  # each in training order: oldest first among what it could take
            assert log.mark_trained(claim_, round_ + 1) == len(claim_)


def test_claimants_draining_the_queue_train_each_entry_once(logs):
    """Two owners each loop claim -> train -> mark, as two replicas' trainers would, while a third appends: each
    entry is trained by exactly one, and all of them are."""
    writer, trainers = logs(), [logs(), logs()]
    trained: list[list[int]] = [[], []]
    done = threading.Event()

    def train(i: int) -> None:
        while True:
            finished = done.is_set()  # read before the claim: an empty claim after the last append ends the loop
            batch = seqs(trainers[i].next_queued(4))
            if not batch and finished:
                return
            assert trainers[i].mark_trained(batch, i + 1) == len(batch)  # nobody settled them under its claim
            trained[i] += batch

    threads = [threading.Thread(target=train, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    added = [writer.append(**submission(f"r{i}"))[0].seq for i in range(60)]
    done.set()
    for t in threads:
        t.join()
    assert sorted(trained[0] + trained[1]) == added
    assert writer.counts("state")["trained"] == 60 and writer.counts("state")["queued"] == 0


def test_a_live_owner_keeps_its_claim_until_its_head_moves_on(logs):
    a, b = logs(), logs()
    thumbs = [a.append(**submission(f"t{i}"))[0].seq for i in range(4)]
    assert seqs(a.next_queued(2)) == thumbs[:2] and seqs(a.next_queued(2)) == thumbs[:2]  # its own: again its own
    assert seqs(b.next_queued(10)) == thumbs[2:]  # what a holds is not b's
    correction = a.append(**submission("c", correction="Better."))[0].seq
    assert seqs(a.next_queued(2)) == [correction, thumbs[0]]  # a correction first: a gives thumbs[1] back
    assert seqs(b.next_queued(10)) == [thumbs[1], *thumbs[2:]]


def test_a_closed_owners_claims_return_to_the_queue(logs):
    a, b = logs(), logs()
    added = [a.append(**submission(f"r{i}"))[0].seq for i in range(5)]
    assert seqs(a.next_queued(3)) == added[:3] and seqs(b.next_queued(10)) == added[3:]
    a.close()
    eventually(lambda: seqs(b.next_queued(10)) == added)


def test_a_killed_processes_claims_return_to_the_queue(postgres_url: str, logs):
    """SIGKILL: no close, the socket closes with the process; the server ends the session and its lock."""
    log = logs()
    added = [log.append(**submission(f"r{i}"))[0].seq for i in range(4)]
    child = f"""
import os, signal
from alchemist.feedback.postgres_log import PostgresFeedbackLog
log = PostgresFeedbackLog({postgres_url!r})
print([e.seq for e in log.next_queued(3)], flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""
    result = subprocess.run([sys.executable, "-c", child], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == -9 and result.stdout.strip() == str(added[:3]), result.stderr
    eventually(lambda: seqs(log.next_queued(10)) == added)


def test_settling_and_release_ignore_claims(logs):
    """Settling is idempotent and anyone's (the trainer that checkpoints may not be the claimant); a released entry
    is nobody's claim."""
    a, b = logs(), logs()
    first, second = (a.append(**submission(f"r{i}"))[0].seq for i in range(2))
    assert seqs(a.next_queued(2)) == [first, second]
    assert b.mark_trained([first], 1) == 1 and a.mark_trained([first], 2) == 0
    assert b.mark_quarantined(second, "loss is high", 9.0) and b.release([second]) == [second]
    assert seqs(b.next_queued(10)) == [second]  # released: no longer a's


def test_the_schema_is_made_once_when_many_connect_at_once(postgres_url: str, logs):
    errors: list[BaseException] = []

    def connect() -> None:
        try:
            logs()
        except BaseException as e:  # the test reports it
            errors.append(e)

    threads = [threading.Thread(target=connect) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    with psycopg.connect(postgres_url) as conn:
        assert conn.execute("SELECT version FROM feedback_schema").fetchall() == [(VERSION,)]


def test_a_version_1_database_gains_the_adapter(postgres_url: str, logs):
    """Entries logged before adapters trained are the shared adapter's (NULL), and stay in its queue."""
    seq = logs().append(**submission("r0"))[0].seq
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute("ALTER TABLE feedback DROP COLUMN adapter")
        conn.execute("UPDATE feedback_schema SET version = 1")
    log = logs()
    assert log.get(seq).adapter is None and seqs(log.next_queued(10)) == [seq]
    assert log.append(**submission("r1", adapter="team-a"))[0].adapter == "team-a"
    with psycopg.connect(postgres_url) as conn:
        assert conn.execute("SELECT version FROM feedback_schema").fetchall() == [(VERSION,)] == [(2,)]


def test_a_database_of_a_newer_schema_is_refused(postgres_url: str, logs):
    logs()
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute("UPDATE feedback_schema SET version = %s", (VERSION + 1,))
    with pytest.raises(ValueError, match="newer"):
        logs()


def test_the_location_picks_the_backend(postgres_url: str, tmp_path):
    for location, kind in ((postgres_url, PostgresFeedbackLog), (str(tmp_path / "f.sqlite"), SQLiteFeedbackLog)):
        log = open_feedback_log(location)
        try:
            assert isinstance(log, kind)
        finally:
            log.close()
    log = open_feedback_log(postgres_url.replace("postgresql://", "postgres://"))
    log.close()


def test_a_broken_connection_fails_the_call_in_flight_and_the_next_connects_again(postgres_url: str, logs):
    """Under a new owner: the old session's claims went with it (they are anyone's, this log's too)."""
    log = logs()
    entry, _ = log.append(**submission("a"))
    assert seqs(log.next_queued(5)) == [entry.seq]
    owner = log.owner
    with psycopg.connect(postgres_url, autocommit=True) as admin:  # what a server restart or a network cut does
        admin.execute("SELECT pg_terminate_backend(%s)", (log._conn.info.backend_pid,))
    with pytest.raises(psycopg.OperationalError):
        log.last_seq()
    assert log.last_seq() == entry.seq and log.owner != owner
    assert seqs(log.next_queued(5)) == [entry.seq]
