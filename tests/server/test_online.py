"""The online loop end to end, on real server processes and the real default model: people correct answers, the
server trains on the corrections between serving steps, and serves what it learned.

- teaching with the default flags (`alchemist serve` as a new user starts it: bf16 where the CPU runs it fast):
  invented facts the model cannot know are asked, each answer that is
  wrong corrected through POST /v1/feedback, at most twice (asked again after each training), while other people
  ask ShareGPT questions nobody gives feedback on (the anchors each step keeps close to the base model);
  afterwards at least 90% of the facts are answered right and the perplexity of held-out ShareGPT replies rose
  by less than 5%, and at least 80% of 30 unrelated ShareGPT questions asked before and after get the same greedy
  answer (the corrections serve only requests like their prompts: docs/architecture.md, "Routing the corrections");
- rollback serves the earlier version's outputs exactly (the base model's, then the taught version's);
- SIGKILL in the middle of training, restart: every acknowledged feedback is in the log, trained exactly once
  overall, and serving resumes from the last checkpointed adapter."""

from __future__ import annotations

import math
import signal
import sqlite3
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from alchemist.bench import http_calls
from alchemist.bench.facts import FACTS, held_out_nll, held_out_replies
from alchemist.bench.serving import stop_process
from alchemist.bench.sharegpt import sample_requests
from alchemist.config import OnlineConfig
from alchemist.training.checkpoint import AdapterCheckpoints
from alchemist.training.rank_split import RankSplit
from tests.server.conftest import MODEL_NAME, ServerProcess, launch_server, wait_ready

pytestmark = pytest.mark.slow  # scheduled first (tests/conftest.py)

CORRECTIONS = 2  # at most, per fact: a wrong answer is corrected, the fact asked again after the training
NUM_OTHERS = 16  # ShareGPT questions asked with each round of facts by people who give no feedback (the anchors)
OTHER_TOKENS = 24  # their answers' length: the anchors' KL positions
UNRELATED, UNRELATED_TOKENS = 30, 32  # ShareGPT questions asked before and after the teaching: their greedy answers


def ask(server: ServerProcess, question: str, max_tokens: int = 24) -> tuple[str, str]:
    """(response id, text) of a greedy answer, its prompt recorded for training."""
    out = server.client().chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": question}],
        max_tokens=max_tokens,
        temperature=0.0,
        extra_body={"alchemist": {"record": True}},
    )
    return out.id, out.choices[0].message.content


def feedback(server: ServerProcess, **body) -> dict:
    response = http_calls.post(server.base_url + "/v1/feedback", json=body, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def adapters(server: ServerProcess) -> dict:
    return http_calls.get(server.base_url + "/v1/adapters", timeout=30).json()


def wait_trained_through(server: ServerProcess, seq: int, timeout_s: float = 600.0) -> dict:
    """Waits until a checkpointed adapter version has trained the log up to ``seq``; returns /v1/adapters."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        listing = adapters(server)
        if any(v["log_position"] >= seq for v in listing["data"]):
            return listing
        if server.process.poll() is not None:
            raise RuntimeError(f"server died:\n{server.log_path.read_text()}")
        time.sleep(0.5)
    raise AssertionError(f"feedback up to seq {seq} not trained within {timeout_s} s: {adapters(server)}")


def stop(server: ServerProcess) -> None:
    stop_process(server.process)


def ask_all(server: ServerProcess, facts: list[int], others: list[str] = ()) -> dict[int, tuple[str, str]]:
    """The questions of ``facts`` (indices into FACTS), and ``others`` (``OTHER_TOKENS``-token answers) beside
    them; returns the facts' answers by index."""
    with ThreadPoolExecutor(len(facts) + len(others)) as pool:  # concurrently, as many users would
        answers = {i: pool.submit(ask, server, FACTS[i][0]) for i in facts}
        for question in others:
            pool.submit(ask, server, question, OTHER_TOKENS)
        return {i: f.result() for i, f in answers.items()}


def knows(answer: tuple[str, str], fact: int) -> bool:
    return FACTS[fact][2] in answer[1].lower()


def other_questions(tokenizer) -> list[list[str]]:
    """CORRECTIONS + 1 rounds of NUM_OTHERS ShareGPT first-turn questions (the traffic beside each round of facts),
    none of them one of the held-out replies' conversations."""
    held_out = {s.messages[0]["content"] for s in held_out_replies(tokenizer)}
    count = (CORRECTIONS + 1) * NUM_OTHERS
    pool = sample_requests(count + 12, seed=11, mode="first_turn", tokenizer=tokenizer, max_prompt_tokens=96)
    questions = list(dict.fromkeys(s.messages[0]["content"] for s in pool if s.messages[0]["content"] not in held_out))
    return [questions[i * NUM_OTHERS : (i + 1) * NUM_OTHERS] for i in range(CORRECTIONS + 1)]


def unrelated_questions(tokenizer, exclude: set[str]) -> list[str]:
    """UNRELATED ShareGPT first-turn questions nobody teaches, asks beside the facts or holds out."""
    held_out = {s.messages[0]["content"] for s in held_out_replies(tokenizer)}
    pool = sample_requests(UNRELATED + 40, seed=29, mode="first_turn", tokenizer=tokenizer, max_prompt_tokens=96)
    questions = dict.fromkeys(s.messages[0]["content"] for s in pool)
    return [q for q in questions if q not in held_out | exclude][:UNRELATED]


def ask_unrelated(server: ServerProcess, questions: list[str]) -> list[str]:
    """One at a time, so that before and after the teaching each answer decodes alone: in bf16 a greedy answer
    depends on the batches it is decoded in (the compiled step at batch 1 and at other sizes, and the eager steps that
    mix in prefills, round differently), which concurrent requests make differ from one run to the next."""
    return [ask(server, q, UNRELATED_TOKENS)[1] for q in questions]


def settle_merge(server: ServerProcess) -> None:
    """A new (or rolled back) adapter is merged into the weights a layer per engine step after the swap; until then
    decoding adds its separate delta, eagerly, which rounds differently from the compiled merged step in bf16. One
    answer of more steps than the model has layers lets the merge finish."""
    ask(server, "Write a long story about the sea.", max_tokens=40)


@pytest.fixture(scope="module")
def taught(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer):
    """A server at its default flags that was asked every fact, each wrong answer corrected and the fact asked
    again, at most CORRECTIONS times, while others asked ShareGPT questions. Also: the first fact's answer asked
    alone, before anything else (what a rollback to the base model must serve again)."""
    log_dir = tmp_path_factory.mktemp("online")
    others = other_questions(smollm2_tokenizer)
    unrelated = unrelated_questions(smollm2_tokenizer, {q for round_ in others for q in round_})
    server = launch_server("teach", log_dir, log_dir / "data", [], dtype="auto")
    facts = list(range(len(FACTS)))
    try:
        wait_ready(server)
        alone = ask(server, FACTS[0][0])[1]  # the first request: nothing cached (bf16 prefills differ in rounding)
        unrelated_before = ask_unrelated(server, unrelated)
        before = answers = ask_all(server, facts, others[0])
        for round_ in range(CORRECTIONS):
            wrong = [i for i in facts if not knows(answers[i], i)]
            if not wrong:
                break
            acks = [feedback(server, response_id=answers[i][0], correction=FACTS[i][1]) for i in wrong]
            wait_trained_through(server, max(int(a["id"].removeprefix("fb-")) for a in acks))
            # Every fact asked again, served by the version that trained this round's corrections.
            answers = ask_all(server, facts, others[round_ + 1])
        settle_merge(server)  # the last version merged: its unrouted answers decode as the first version's did
        unrelated_after = ask_unrelated(server, unrelated)
        yield server, before, answers, adapters(server), alone, (unrelated_before, unrelated_after)
    finally:
        stop(server)


def test_served_answers_learn_the_corrected_facts(taught):
    server, before, after, listing, _, _ = taught
    assert not any(knows(before[i], i) for i in before)  # it could not know them
    learned = [knows(after[i], i) for i in after]
    print(f"facts learned: {sum(learned)} of {len(FACTS)}")
    assert sum(learned) >= 0.9 * len(FACTS), [text for _, text in after.values()]
    corrected = [seq for v in listing["data"] for seq in v["metrics"].get("seqs", [])]
    assert len(corrected) <= CORRECTIONS * len(FACTS)
    metrics = server.metrics()
    assert metrics['alchemist:training_samples_total{path="replay"}'] > 0, metrics  # records were replayed
    assert metrics["alchemist:training_records_unreadable_total"] == 0


def test_held_out_perplexity_rises_less_than_five_percent(taught, smollm2, smollm2_tokenizer):
    """The facts were taught without making the model worse at everything else: the perplexity of held-out
    ShareGPT replies (12 conversations nobody asked here) rose by less than 5%."""
    server, _, _, listing, _, _ = taught
    latest = max(v["version"] for v in listing["data"])
    checkpoints = AdapterCheckpoints(server.data_dir / "adapters", keep=100)
    adapter, _, _ = checkpoints.load(latest, smollm2.model.config)
    # as trained: the corrections' ranks on the replies' rows (as if every held-out question were routed to them)
    RankSplit(adapter, OnlineConfig().adapter.preference_r, cut=True)
    taught_nll, base_nll = (held_out_nll(smollm2.model, smollm2_tokenizer, lora).mean() for lora in (adapter, None))
    rise = math.exp(taught_nll - base_nll) - 1
    print(f"held-out perplexity rise: {rise:.1%}")
    assert rise < 0.05, f"held-out perplexity rose {rise:.1%}"
    assert all(v["metrics"]["anchors"] > 0 for v in listing["data"])  # every step had its anchors


def test_unrelated_answers_stay_as_they_were(taught):
    """Greedy answers to 30 ShareGPT questions nobody taught: at least 80% are the same after the teaching."""
    _, _, _, listing, _, (before, after) = taught
    same = sum(a == b for a, b in zip(before, after, strict=True))
    print(f"unrelated answers unchanged: {same} of {len(before)}")
    assert same >= 0.8 * len(before), [(a, b) for a, b in zip(before, after, strict=True) if a != b]
    assert max(v["version"] for v in listing["data"]) > 0  # something was taught in between


def test_rollback_serves_the_earlier_outputs_exactly(taught):
    server, _, _, _, alone, _ = taught
    question = FACTS[0][0]
    trained = adapters(server)["serving_version"]
    taught_answer = ask(server, question)[1]
    response = http_calls.post(server.base_url + "/v1/adapters/rollback", json={"version": 0}, timeout=60)
    assert response.status_code == 200, response.text
    assert adapters(server)["serving_version"] == response.json()["version"] > trained
    settle_merge(server)
    assert ask(server, question)[1] == alone  # the base model's answer, exactly
    response = http_calls.post(server.base_url + "/v1/adapters/rollback", json={"version": trained}, timeout=60)
    assert response.status_code == 200, response.text
    settle_merge(server)
    assert ask(server, question)[1] == taught_answer  # the taught version's answer, exactly
    missing = http_calls.post(server.base_url + "/v1/adapters/rollback", json={"version": 999}, timeout=30)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "adapter_not_found"


def test_sigkill_mid_training_loses_nothing_and_trains_once(tmp_path: Path):
    flags = [
        *("--max-num-seqs", "4", "--max-model-len", "512", "--record-policy", "requested"),
        *("--train-batch-size", "2", "--train-max-wait-s", "0.2", "--train-epochs", "3"),
        *("--keep-adapter-versions", "100"),
    ]
    data = tmp_path / "data"
    # The default dtype (bf16 where the CPU runs it fast), as users run it; it trains in half fp32's time here.
    server = launch_server("crash", tmp_path, data, flags, dtype="auto")
    wait_ready(server)
    questions = [q for q, _, _ in FACTS[:4]]  # two batches: the kill lands in the second
    with ThreadPoolExecutor(len(questions)) as pool:
        answers = list(pool.map(lambda q: ask(server, q), questions))
    fixes = [fix for _, fix, _ in FACTS[:4]]
    acked = [
        feedback(server, response_id=rid, correction=fix)["id"] for (rid, _), fix in zip(answers, fixes, strict=True)
    ]
    seqs = sorted(int(a.removeprefix("fb-")) for a in acked)
    # Kill it in the middle: the first batch checkpointed (3 epochs: 3 optimizer steps), the second one in training.
    deadline = time.monotonic() + 300
    while server.metrics().get("alchemist:training_steps_total", 0) < 4:
        assert time.monotonic() < deadline, "training never got to the second batch"
        time.sleep(0.05)
    assert not any(v["log_position"] >= seqs[-1] for v in adapters(server)["data"]), "trained it all: too late"
    server.process.send_signal(signal.SIGKILL)
    server.process.wait()

    checkpoints = AdapterCheckpoints(data / "adapters", keep=100)
    latest = checkpoints.latest()
    assert latest is not None and latest.log_position < seqs[-1]
    # Restarted without training: it serves exactly the last checkpointed version.
    server = launch_server("crash-restart", tmp_path, data, [*flags, "--no-train"], dtype="auto")
    wait_ready(server)
    assert adapters(server)["serving_version"] == latest.version
    stop(server)
    # Restarted with training: it trains the rest, and nothing twice.
    server = launch_server("crash-resume", tmp_path, data, flags, dtype="auto")
    try:
        wait_ready(server)
        wait_trained_through(server, seqs[-1])
    finally:
        stop(server)

    with sqlite3.connect(f"file:{data / 'feedback.sqlite'}?mode=ro", uri=True) as db:
        logged = sorted(seq for (seq,) in db.execute("SELECT seq FROM feedback WHERE kind = 'sft'"))
    assert logged == seqs  # every acknowledged feedback is in the log
    trained = [seq for v in AdapterCheckpoints(data / "adapters", keep=100).versions() for seq in v.metrics["seqs"]]
    assert sorted(trained) == seqs  # each trained in exactly one checkpointed version
