"""`alchemist bench serve` end to end on a tiny workload: against a real `alchemist serve` that the test starts, by
``--base-url`` (both workloads, concurrency 1 and 2), and against the server it starts itself (the default target),
also with its requests spread over named adapters (``--adapters``). Every row's fields present, finite and ordered,
nothing failed, every request's output exactly ``--max-tokens``. Speed is not asserted. Plus the plan: no prompt
repeats across levels or workloads unless ``--reuse-prompts``; with adapters, round-robin over a0..a{K-1}."""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys

import pytest

from alchemist.bench.serving import plan_workloads
from alchemist.model.loader import hf_dir_for
from alchemist.model.tokenizer import Tokenizer
from tests.server.conftest import launch_server, wait_ready

pytestmark = pytest.mark.slow  # scheduled first (tests/conftest.py)

MAX_TOKENS = 8
CMD = [sys.executable, "-m", "alchemist.cli", "bench", "serve", "--json", "--requests-per-level", "2"]
CMD += ["--max-tokens", str(MAX_TOKENS), "--max-prompt-tokens", "128", "--dtype", "float32", "--device", "cpu"]
FIELDS = (
    "duration_s", "output_tok_s", "prompt_tokens_mean", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms",
    "itl_p50_ms", "itl_p99_ms",
)  # fmt: skip


def run_bench(*flags: str) -> list[dict]:
    done = subprocess.run([*CMD, *flags], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines()]


def assert_sane(row: dict, concurrency: int) -> None:
    assert row["system"] == "http" and row["concurrency"] == concurrency and row["failed"] == 0, row
    assert row["requests"] >= max(4, 2 * concurrency)
    if row["workload"] == "first_turn":
        assert row["requests"] == max(4, 2 * concurrency)
    assert row["output_tokens"] == row["requests"] * MAX_TOKENS  # forced: max_tokens = min_tokens, EOS ignored
    for field in FIELDS:
        assert row[field] is not None and math.isfinite(row[field]) and row[field] > 0, (row, field)
    for metric in ("ttft", "tpot", "itl"):
        assert row[f"{metric}_p50_ms"] <= row[f"{metric}_p99_ms"], (row, metric)


def test_bench_serve_against_a_url(tmp_path):
    flags = ["--max-num-seqs", "2", "--max-model-len", "256", "--no-train"]
    server = launch_server("bench", tmp_path, tmp_path / "data", flags)  # fp32 on the CPU
    try:
        wait_ready(server)
        rows = run_bench(
            "--base-url", server.base_url + "/v1", "--workloads", "first_turn", "multi_turn", "--concurrency", "1", "2"
        )  # fmt: skip
    finally:
        server.process.terminate()
        server.process.wait(timeout=30)
    assert [(r["workload"], r["concurrency"]) for r in rows] == [
        ("first_turn", 1), ("first_turn", 2), ("multi_turn", 1), ("multi_turn", 2)
    ]  # fmt: skip
    for row in rows:
        assert_sane(row, row["concurrency"])


def test_bench_serve_default_target():
    """No --base-url: the bench starts `alchemist serve` itself (and stops it)."""
    rows = run_bench("--concurrency", "1")
    assert [(r["workload"], r["concurrency"]) for r in rows] == [("first_turn", 1)]
    assert_sane(rows[0], 1)


def test_bench_serve_over_named_adapters():
    """--adapters 1 2: the bench makes two adapters and starts the server with both; a row per K, every request
    answered, by each of that K's adapters (the responses' ``model``)."""
    rows = run_bench("--adapters", "1", "2", "--concurrency", "2", "--enforce-eager")
    assert [(r["adapters"], r["concurrency"]) for r in rows] == [(1, 2), (2, 2)]
    for row in rows:
        assert_sane(row, 2)
        assert row["adapters_answered"] == row["adapters"], row
        assert row["x_1_adapter"] > 0


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_pretrained(hf_dir_for(None))


def plan(tokenizer: Tokenizer, reuse: bool, adapters: list[int] | None = None):
    args = argparse.Namespace(
        seed=0, workloads=["first_turn", "multi_turn"], concurrency=[1, 4], requests_per_level=2, max_tokens=32,
        max_prompt_tokens=256, reuse_prompts=reuse, adapters=adapters,
    )  # fmt: skip
    return plan_workloads(args, tokenizer)


def test_levels_and_workloads_draw_disjoint_conversations(tokenizer):
    p = plan(tokenizer, reuse=False)
    first_turns = [chat.turns[0] for chats in p.cells.values() for chat in chats] + [p.warmup.turns[0]]
    assert len(first_turns) == len(set(first_turns))  # no conversation twice, warm-up included
    assert [len(p.cells[("first_turn", None, c)]) for c in (1, 4)] == [4, 8]
    for c in (1, 4):
        chats = p.cells[("multi_turn", None, c)]
        assert all(len(chat.turns) >= 2 for chat in chats) and len(chats) >= c
        assert sum(len(chat.turns) for chat in chats) >= max(4, 2 * c)
    assert 0 < max(p.prompt_tokens["multi_turn"]) <= 256 and max(p.prompt_tokens["first_turn"]) <= 256


def test_reuse_prompts_shares_a_workloads_conversations_across_levels(tokenizer):
    p = plan(tokenizer, reuse=True)
    for workload in ("first_turn", "multi_turn"):
        small, large = p.cells[(workload, None, 1)], p.cells[(workload, None, 4)]
        assert large[: len(small)] == small
    assert not set(p.cells[("first_turn", None, 4)]) & set(p.cells[("multi_turn", None, 4)])


def test_adapter_levels_draw_their_own_conversations_round_robin_over_the_adapters(tokenizer):
    p = plan(tokenizer, reuse=False, adapters=[1, 2])
    for workload in ("first_turn", "multi_turn"):
        for k in (1, 2):
            assert [chat.model for chat in p.cells[(workload, k, 4)][:4]] == [f"a{i % k}" for i in range(4)]
    first_turns = [chat.turns[0] for chats in p.cells.values() for chat in chats]
    assert len(first_turns) == len(set(first_turns))  # K = 2 does not resend K = 1's prompts to a0
