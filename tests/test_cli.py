"""The command line, as a user runs it (a real subprocess)."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from tests.model.test_smollm2 import greedy_with_cache


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "alchemist.cli", *args], capture_output=True, text=True, timeout=timeout
    )


def test_generate_is_greedy_chat_completion(smollm2):
    prompt = "What is the capital of France?"
    done = run_cli("generate", "--prompt", prompt, "--max-tokens", "12", "--dtype", "float32")
    assert done.returncode == 0, done.stderr
    ids = torch.tensor(smollm2.tokenizer.apply_chat_template([{"role": "user", "content": prompt}]))
    expected = greedy_with_cache(smollm2.model, ids, 12)
    eos = set(smollm2.tokenizer.eos_token_ids)
    expected = expected[: next((i for i, t in enumerate(expected) if t in eos), len(expected))]
    assert done.stdout.strip() == smollm2.tokenizer.decode(expected).strip()
    assert "Paris" in done.stdout


def test_bad_model_path_is_a_clear_error(tmp_path):
    done = run_cli("generate", "--prompt", "hi", "--model", str(tmp_path / "missing"))
    assert done.returncode == 2
    assert "model path does not exist" in done.stderr and "missing" in done.stderr


def test_bench_forward_json_rows():
    done = run_cli("bench", "forward", "--prompt-tokens", "16", "--repeats", "1", "--json")
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 1 and rows[0]["prompt_tokens"] == 16 and rows[0]["ours_s"] > 0


def test_bench_memory_help_and_bad_shape():
    done = run_cli("bench", "memory", "--help")
    assert done.returncode == 0, done.stderr
    for flag in ("--shapes", "--repeats", "--budget-mib", "--record-dtype", "--prefetch-depth", "--json"):
        assert flag in done.stdout
    done = run_cli("bench", "memory", "--shapes", "8192x128")
    assert done.returncode == 2 and "--shapes 8192x128" in done.stderr and "context" in done.stderr


def test_serve_flags_map_onto_the_online_config():
    """Each training flag of `serve` lands in its OnlineConfig field: the defaults give OnlineConfig's defaults,
    and set flags their values."""
    from alchemist.config import OnlineConfig
    from alchemist.config.parse import parse_config

    assert parse_config([]).online == OnlineConfig()
    got = parse_config(["--train-group-size", "2", "--train-group-max-tokens", "0",
                        "--train-max-wait-s", "4", "--no-train", "--train-no-replay"]).online  # fmt: skip
    assert (got.trainer.group_size, got.trainer.group_max_tokens, got.queue.max_wait_s) == (2, 0, 4.0)
    assert not got.enabled and not got.trainer.replay


def test_serve_prefix_caching_flag():
    from alchemist.config.parse import parse_config

    assert parse_config([]).engine.enable_prefix_caching
    assert not parse_config(["--no-enable-prefix-caching"]).engine.enable_prefix_caching


def test_serve_help_groups_the_flags_and_errors_name_the_flag():
    done = run_cli("serve", "--help")
    assert done.returncode == 0, done.stderr
    for group in ("engine options", "record options", "online options", "online.trainer options", "server options"):
        assert group in done.stdout
    done = run_cli("serve", "--record-budget-mb", "-1")
    assert done.returncode == 2
    assert "--record-budget-mb must be an integer >= 0 (got -1)" in done.stderr, done.stderr


def test_bench_online_takes_serve_flags():
    """`bench online`'s servers are configured by serve's own parser: its flags, checked, with the bench's defaults."""
    from alchemist.bench.cli import online_servers
    from alchemist.cli import _serve_flags
    from alchemist.config.parse import parse_config

    argv = ["bench", "online", "--json", "--max-num-seqs", "4", "--runs", "off", "--train-no-replay", "--seed", "1"]
    rest, serve = _serve_flags(argv)
    assert rest == ["bench", "online", "--json", "--runs", "off", "--seed", "1"]
    config = parse_config(serve, online_servers())
    assert (config.engine.max_num_seqs, config.record.store_budget_bytes, config.online.queue.max_wait_s) == (
        4, 4 << 30, 5.0)  # fmt: skip
    assert not config.online.trainer.replay
    done = run_cli("bench", "online", "--train-lr", "0")
    assert done.returncode == 2 and "--train-lr must be positive" in done.stderr, done.stderr


def test_bench_paper_takes_serve_flags():
    """`bench paper`, like `bench online`: --model and every serve flag go to serve's parser, its own flags stay."""
    from alchemist.cli import _serve_flags

    argv = ["bench", "paper", "--model", "m", "--buckets", "0", "128", "--lora-r", "8", "--rates", "1", "2", "--json"]
    rest, serve = _serve_flags(argv)
    assert rest == ["bench", "paper", "--buckets", "0", "128", "--rates", "1", "2", "--json"]
    assert serve == ["--model", "m", "--lora-r", "8"]


def test_serve_with_the_example_config_answers(tmp_path):
    """`alchemist serve --config examples/serve.yaml` serves: one chat completion through the official client."""
    from tests.server.conftest import MODEL_NAME, launch_server, wait_ready

    server = launch_server("example-config", tmp_path, tmp_path / "data", ["--config", "examples/serve.yaml"])
    try:
        wait_ready(server)
        reply = server.client().chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "Say hi."}], max_tokens=4, temperature=0
        )
        assert reply.choices[0].message.content and reply.usage.completion_tokens >= 1
    finally:
        server.process.terminate()
        server.process.wait(timeout=60)
