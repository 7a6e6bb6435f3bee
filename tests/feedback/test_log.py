"""The feedback log's contract (``alchemist.feedback.log.FeedbackLog``), run against every implementation: durable
appends (across processes, through SIGKILL), idempotency, reads by position, states, the trainer's queue, counts and
listeners. Every implementation runs all of it by being in ``BACKENDS``: SQLite, and PostgreSQL on a throwaway
server (alchemist/bench/postgres.py). What only SQLite has (its WAL mode, its schema migrations):
tests/feedback/test_sqlite_log.py; what only PostgreSQL has (claims across processes):
tests/feedback/test_postgres_log.py; the trainer's policy over what the log returns: tests/training/test_taught.py
and test_regression.py."""

from __future__ import annotations

import inspect
import json
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from alchemist.feedback.adapter_log import AdapterLog
from alchemist.feedback.log import FeedbackEntry, FeedbackLog
from alchemist.feedback.postgres_log import PostgresFeedbackLog
from alchemist.feedback.sqlite_log import SQLiteFeedbackLog

REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Backend:
    """How to open one implementation's log on the same storage, in this process and in a fresh one."""

    open: Callable[[], FeedbackLog]
    source: str  # Python that binds ``log`` to the log, for a child process


def sqlite_backend(request: pytest.FixtureRequest) -> Backend:
    path = request.getfixturevalue("tmp_path") / "data" / "feedback.sqlite"  # the directory does not exist yet
    source = f"from alchemist.feedback.sqlite_log import SQLiteFeedbackLog\nlog = SQLiteFeedbackLog({str(path)!r})\n"
    return Backend(lambda: SQLiteFeedbackLog(path), source)


def postgres_backend(request: pytest.FixtureRequest) -> Backend:
    url = request.getfixturevalue("postgres_url")  # a fresh database on the test run's throwaway server
    source = f"from alchemist.feedback.postgres_log import PostgresFeedbackLog\nlog = PostgresFeedbackLog({url!r})\n"
    return Backend(lambda: PostgresFeedbackLog(url), source)


BACKENDS = {"sqlite": sqlite_backend, "postgresql": postgres_backend}
IMPLEMENTATIONS = [SQLiteFeedbackLog, PostgresFeedbackLog]


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


def run_python(backend: Backend, code: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter, after the backend has bound ``log``."""
    return subprocess.run(
        [sys.executable, "-c", backend.source + textwrap.dedent(code)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


@pytest.fixture(params=sorted(BACKENDS))
def backend(request) -> Backend:
    return BACKENDS[request.param](request)


@pytest.fixture
def log(backend: Backend):
    log = backend.open()
    yield log
    log.close()


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS, ids=lambda cls: cls.__name__)
def test_an_implementation_has_every_method_of_the_protocol_with_its_signature(implementation: type):
    """The Protocol is the one place callers learn the log from: an implementation may not drift from it."""
    methods = [name for name, member in vars(FeedbackLog).items() if inspect.isfunction(member)
               and not name.startswith("_")]  # fmt: skip
    assert len(methods) == 22
    for name in methods:
        promised = inspect.signature(getattr(FeedbackLog, name))
        assert str(inspect.signature(getattr(implementation, name))) == str(promised), name


def test_the_log_under_test_is_a_feedback_log(log: FeedbackLog):
    assert isinstance(log, FeedbackLog)


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


def test_counts_by_kind_and_by_state(log: FeedbackLog):
    assert log.counts("kind") == {"sft": 0, "negative": 0, "preference": 0}
    assert log.counts("state") == {"queued": 0, "trained": 0, "skipped": 0, "quarantined": 0}
    log.append(**submission("a"))
    log.append(**submission("b", correction="x"))
    log.append(**submission("c", kind="negative", rating=-1))
    log.append(**submission("c", kind="negative", rating=-1))  # a repeat
    assert log.counts("kind") == {"sft": 2, "negative": 1, "preference": 0}
    log.mark_skipped([1], "why")
    assert log.counts("state") == {"queued": 2, "trained": 0, "skipped": 1, "quarantined": 0}
    with pytest.raises(ValueError, match="kind"):
        log.counts("rating")


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


def test_a_fresh_process_reads_what_another_wrote(backend: Backend, log: FeedbackLog):
    entry, _ = log.append(**submission(correction="Fixed."))
    result = run_python(backend, """
        import json
        print(json.dumps([e.__dict__ for e in log.read()]))
        log.append(response_id="from-child", kind="negative", rating=-1, prompt_token_ids=[1],
                   response_token_ids=[2], output_token_ids=[2], adapter_version=0, recorded=False)
    """)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == [entry.__dict__]
    assert [e.response_id for e in log.read()] == ["chatcmpl-1", "from-child"]  # and the other way round


def test_an_append_survives_sigkill_right_after_it_returns(backend: Backend):
    result = run_python(backend, """
        import os, signal
        entry, created = log.append(response_id="killed", kind="sft", rating=1, prompt_token_ids=[1, 2],
                                    response_token_ids=[3, 2], output_token_ids=[3, 2], adapter_version=1,
                                    recorded=True)
        assert created
        os.kill(os.getpid(), signal.SIGKILL)  # no close, no checkpoint, no atexit
    """)
    assert result.returncode == -signal.SIGKILL, result.stderr
    log = backend.open()
    try:
        [entry] = log.read()
        assert (entry.seq, entry.response_id, entry.response_token_ids) == (1, "killed", [3, 2])
    finally:
        log.close()


def test_comment_metadata_and_a_client_id_are_kept(log: FeedbackLog):
    meta = {"source": "langfuse", "trace": {"id": "t-1", "tags": ["a", "b"]}, "score": 0.5}
    entry, created = log.append(**submission(comment="Too long.", metadata=meta, feedback_id="client-7"))
    assert created and (entry.comment, entry.metadata, entry.feedback_id) == ("Too long.", meta, "client-7")
    assert log.read() == [entry] and log.get(entry.seq) == entry and log.get(99) is None
    assert log.find(feedback_id="client-7") == entry and log.find(feedback_id="client-8") is None
    with pytest.raises(ValueError, match="one of the two"):
        log.find(entry.idempotency_key, feedback_id="client-7")
    # The client's id is the key: a retry under it finds the entry, whatever else the log would hash.
    again, created_again = log.append(**submission(comment="Too long.", metadata=meta, feedback_id="client-7"))
    assert not created_again and again == entry
    # Without an id, the same rating with another comment is other feedback; with neither, the old key.
    other, created_other = log.append(**submission(comment="Fine."))
    plain, created_plain = log.append(**submission())
    assert created_other and created_plain and len({entry.seq, other.seq, plain.seq}) == 3
    with pytest.raises(ValueError, match="metadata"):
        log.append(**submission("x", metadata=["not", "an", "object"]))


def test_states_settle_once_with_their_version_or_reason(log: FeedbackLog):
    seqs = [log.append(**submission(f"r{i}"))[0].seq for i in range(4)]
    assert {e.state for e in log.read()} == {"queued"} and log.queued_seqs() == [(s, "sft") for s in seqs]
    assert log.mark_trained(seqs[:2], 7) == 2
    assert log.mark_skipped(seqs[1:3], "too old") == 1  # seqs[1] is trained already: it stays so
    assert log.mark_trained(seqs[:1], 9) == 0
    with pytest.raises(ValueError, match="reason"):
        log.mark_skipped(seqs[3:], "")
    states = [(e.state, e.trained_version, e.skip_reason) for e in log.read()]
    assert states == [("trained", 7, None), ("trained", 7, None), ("skipped", None, "too old"), ("queued", None, None)]
    assert all((e.settled_s is None) == (e.state == "queued") for e in log.read())
    assert log.queued_seqs() == [(seqs[3], "sft")] and log.queued_seqs(through_seq=seqs[2]) == []


def test_trained_corrections_in_a_window_either_way_with_their_versions(log: FeedbackLog):
    """The taught facts: trained corrections only (never a rating, nor one still queued), with the version that
    trained each (what a rollback's undone ranges are judged by, alchemist.training.taught)."""
    seqs = [log.append(**submission(f"r{i}", correction=f"Fact {i}."))[0].seq for i in range(5)]
    rating = log.append(**submission("thumb"))[0].seq
    log.append(**submission("queued", correction="Not yet."))
    for version, seq in enumerate(seqs, start=1):
        log.mark_trained([seq], version)
    log.mark_trained([rating], 5)
    assert [e.seq for e in log.trained_corrections(10)] == seqs
    assert [e.trained_version for e in log.trained_corrections(10)] == [1, 2, 3, 4, 5]
    assert [e.seq for e in log.trained_corrections(10, newest_first=True)] == seqs[::-1]
    assert [e.seq for e in log.trained_corrections(2, newest_first=True)] == seqs[:2:-1]
    assert [e.seq for e in log.trained_corrections(2, after_seq=seqs[0])] == seqs[1:3]
    assert [e.seq for e in log.trained_corrections(10, before_seq=seqs[3], newest_first=True)] == seqs[2::-1]
    assert [e.seq for e in log.trained_corrections(10, seqs[0], seqs[3])] == seqs[1:3]
    assert log.trained_corrections(10, after_seq=seqs[-1]) == []


def test_ratings_per_version_and_key(log: FeedbackLog):
    log.append(**submission("a", key_name="alice"))
    log.append(**submission("b", kind="negative", rating=-1, key_name="alice"))
    log.append(**submission("c", kind="negative", rating=-1, adapter_version=4))
    log.append(**submission("d", rating=None, correction="Fixed.", key_name="alice"))  # no rating: not counted
    assert log.ratings() == {(3, "alice"): (1, 1), (4, None): (0, 1)}


def test_reads_by_state(log: FeedbackLog):
    seqs = [log.append(**submission(f"r{i}"))[0].seq for i in range(4)]
    log.mark_trained(seqs[1:3], 2)
    assert [e.seq for e in log.read(state="trained")] == seqs[1:3]
    assert [e.seq for e in log.read(after_seq=seqs[1], limit=1, state="trained")] == [seqs[2]]
    assert [e.seq for e in log.read(state="queued")] == [seqs[0], seqs[3]] and log.read(state="skipped") == []
    with pytest.raises(ValueError, match="limit"):
        log.read(limit=0)


def test_the_oldest_queued_entry_of_a_class_outside_a_batch(log: FeedbackLog):
    """What a batch in training yields to: the longest-waiting queued correction that is not its own."""
    seqs = [log.append(**submission(f"r{i}", correction=f"Fact {i}."))[0].seq for i in range(3)]
    thumb = log.append(**submission("thumb"))[0]
    created = {e.seq: e.created_s for e in log.read()}
    assert log.oldest_queued("correction") == created[seqs[0]]
    assert log.oldest_queued("correction", excluding=seqs[:2]) == created[seqs[2]]
    assert log.oldest_queued("correction", excluding=seqs) is None
    assert log.oldest_queued("thumbs_up") == thumb.created_s
    log.mark_trained(seqs[2:], 1)
    assert log.oldest_queued("correction", excluding=seqs[:2]) is None  # trained: no longer waiting


def test_a_quarantined_entry_is_settled_for_now_and_released_first_in_line(log: FeedbackLog):
    seqs = [log.append(**submission(f"r{i}"))[0].seq for i in range(3)]
    assert log.mark_quarantined(seqs[0], "loss is nan", float("nan")) and not log.mark_quarantined(seqs[0], "x", 1.0)
    held = log.get(seqs[0])
    assert (held.state, held.quarantine_reason, held.quarantine_loss) == ("quarantined", "loss is nan", None)
    assert log.settled_through() == seqs[0] and log.counts("state")["quarantined"] == 1  # held: settled for now
    assert [e.seq for e in log.next_queued(10)] == seqs[1:] and log.queued_seqs() == [(s, "sft") for s in seqs[1:]]
    assert log.mark_trained(seqs[1:], 2) == 2 and log.settled_through() == seqs[-1]
    assert log.release([seqs[0], seqs[1], 999]) == [seqs[0]]  # only a held entry is released
    released = log.get(seqs[0])
    assert (released.state, released.settled_s, released.quarantine_reason) == ("queued", None, "loss is nan")
    assert released.released_s is not None and [e.seq for e in log.quarantined()] == [seqs[0]]
    assert log.queued_seqs() == []  # behind the position on purpose: restore must not settle it
    new = log.append(**submission("later", correction="A correction."))[0].seq
    assert [e.seq for e in log.next_queued(10)] == [seqs[0], new]  # released first, even before corrections
    log.mark_trained([seqs[0]], 4)
    assert log.quarantined() == [] and log.get(seqs[0]).trained_version == 4


def test_one_key_takes_at_most_its_share_while_others_wait_and_fills_the_rest(log: FeedbackLog):
    """A flood from one key: each other key's entries get their places first, the flood's excess waits in line
    (still queued, never dropped) and fills what is left; entries without a key count as one key."""
    flood = [log.append(**submission(f"m{i}", correction="Wrong.", key_name="mallory"))[0].seq for i in range(6)]
    alice = [log.append(**submission(f"a{i}", key_name="alice"))[0].seq for i in range(2)]
    anonymous = log.append(**submission("n0"))[0].seq
    assert log.get(flood[0]).key_name == "mallory" and log.get(anonymous).key_name is None
    assert [e.seq for e in log.next_queued(4)] == flood[:4]  # no cap: corrections first, oldest first
    assert [e.seq for e in log.next_queued(4, per_key=2)] == [*flood[:2], *alice]
    assert [e.seq for e in log.next_queued(8, per_key=2)] == [*flood[:2], *alice, anonymous, *flood[2:5]]
    log.mark_trained([*flood[:2], *alice, anonymous], 1)
    assert [e.seq for e in log.next_queued(4, per_key=2)] == flood[2:]  # nobody else waits: the flood fills it


def test_a_replica_takes_its_own_responses_feedback_first(log: FeedbackLog):
    """``own``: a replica's responses' id tag (alchemist.scale.replica.id_tag); their entries, whose records it
    holds, come first in their class (corrections still before ratings), then the others', oldest first."""
    theirs = [log.append(**submission(f"chatcmpl-r0-{i}", key_name="alice"))[0].seq for i in range(3)]
    mine = [log.append(**submission(f"chatcmpl-r1-{i}", key_name="bob"))[0].seq for i in range(2)]
    fix = log.append(**submission("cmpl-r0-9", correction="Better.", key_name="alice"))[0].seq
    assert [e.seq for e in log.next_queued(4)] == [fix, *theirs]  # no preference: corrections, then oldest
    assert [e.seq for e in log.next_queued(4, own="-r1-")] == [fix, *mine, theirs[0]]
    assert [e.seq for e in log.next_queued(6, per_key=2, own="-r1-")] == [fix, *mine, theirs[0], *theirs[1:]]
    assert [e.seq for e in log.next_queued(2, own="-r7-")] == [fix, theirs[0]]  # none of its own: the others'




def test_each_adapter_has_its_own_queue_position_and_history(log: FeedbackLog):
    """An entry names the adapter that served its response (None: the shared one); each adapter's trainer sees only
    its own: the shared queue only NULL's, a named adapter's (``AdapterLog``, or ``adapter=``) only its name's."""
    shared = [log.append(**submission(f"s{i}", correction=f"Shared {i}."))[0].seq for i in range(2)]
    team_a = [log.append(**submission(f"a{i}", correction=f"A {i}.", adapter="team-a"))[0].seq for i in range(3)]
    team_b = log.append(**submission("b0", kind="negative", rating=-1, adapter="team-b", adapter_version=7))[0].seq
    assert [log.get(seq).adapter for seq in (shared[0], team_a[0], team_b)] == [None, "team-a", "team-b"]
    view = AdapterLog(log, "team-a")
    protocol = [name for name, member in vars(FeedbackLog).items() if inspect.isfunction(member)]
    assert all(callable(getattr(view, name)) for name in protocol) and view.get(team_a[0]) == log.get(team_a[0])
    assert [e.seq for e in log.next_queued(10)] == shared
    assert [e.seq for e in log.next_queued(10, adapter="team-a")] == [e.seq for e in view.next_queued(10)] == team_a
    assert [e.seq for e in log.next_queued(10, adapter="team-b")] == [team_b]
    assert log.next_queued(10, adapter="team-c") == []
    assert log.queued_seqs() == [(s, "sft") for s in shared] and view.queued_seqs() == [(s, "sft") for s in team_a]
    assert log.backlog_by_adapter() == {None: 2, "team-a": 3, "team-b": 1}
    created = {e.seq: e.created_s for e in log.read()}
    assert view.oldest_queued("correction") == created[team_a[0]]
    assert log.oldest_queued("correction") == created[shared[0]] and log.oldest_queued("thumbs_down") is None
    # Positions: another adapter's queued entries hold no adapter's position back.
    log.mark_trained(shared, 1)
    assert log.settled_through() == log.last_seq() and view.settled_through() == team_a[0] - 1
    assert log.settled_through(adapter="team-b") == team_b - 1
    log.mark_trained(team_a[:2], 1)
    assert view.settled_through(excluding=team_a[2:]) == log.last_seq()
    assert [e.seq for e in log.trained_corrections(10)] == shared
    assert [e.seq for e in view.trained_corrections(10, newest_first=True)] == team_a[1::-1]
    assert log.ratings() == {(3, None): (2, 0)} and view.ratings() == {(3, None): (3, 0)}
    assert log.ratings(adapter="team-b") == {(7, None): (0, 1)}
    # The backlog policy skips only its own adapter's entries.
    assert view.skip_queued_before(["correction", "thumbs_down"], float("inf"), "behind") == 1
    assert log.get(team_a[2]).state == "skipped" and log.get(team_b).state == "queued"
    assert log.backlog_by_adapter() == {"team-b": 1}
