"""The online benchmarks' workload and their watch on training: requests that ask invented facts and are
corrected with them (``--feedback fact``), and each correction's time to serve read from the versions that trained
it, not only from the log position (a batch may carry an older entry past a newer one)."""

from __future__ import annotations

import argparse
import time

from alchemist.bench.backlog import TrainedThrough
from alchemist.bench.facts import invented_facts
from alchemist.bench.online import build_workload


def spec(feedback: str) -> argparse.Namespace:
    return argparse.Namespace(num_requests=16, seed=3, mode="first_turn", max_prompt_tokens=96, request_rate=1.0,
                              feedback_fraction=0.25, max_tokens=24, feedback=feedback)  # fmt: skip


def test_fact_feedback_asks_an_invented_fact_and_corrects_it(smollm2_tokenizer):
    plain = build_workload(spec("correction"), smollm2_tokenizer)
    facts = build_workload(spec("fact"), smollm2_tokenizer)
    asked = [i for i, f in enumerate(facts.feedback) if f is not None]
    assert asked == [i for i, f in enumerate(plain.feedback) if f is not None] and len(asked) == 4
    expected = invented_facts(4, seed=3)
    for i, (question, correction, _) in zip(asked, expected, strict=True):
        assert facts.chats[i] == [{"role": "user", "content": question}]
        assert facts.feedback[i] == {"correction": correction}
        assert facts.prompt_tokens[i] == len(smollm2_tokenizer.apply_chat_template(facts.chats[i]))
    others = [i for i in range(16) if i not in asked]
    assert [facts.chats[i] for i in others] == [plain.chats[i] for i in others]
    assert facts.arrivals_s == plain.arrivals_s and facts.max_tokens == plain.max_tokens


def test_served_after_reads_the_versions_seqs_and_the_position():
    reads = iter([(2, {5}), (6, {5, 3}), (6, {5, 3})])
    watch = TrainedThrough(lambda: next(reads), interval_s=60.0)
    at = time.perf_counter()
    watch._poll()  # the first version trained 5, carried past 3 and 4
    first = watch.seen[-1][0]
    watch._poll()
    second = watch.seen[-1][0]
    assert watch.served_after(5, at) == first - at and watch.served_after(1, at) == first - at
    assert watch.served_after(3, at) == second - at and watch.served_after(6, at) == second - at
    assert watch.served_after(7, at) is None
    assert watch.served_after(5, first + 1.0) == 0.0  # seen before ``at``: at once
