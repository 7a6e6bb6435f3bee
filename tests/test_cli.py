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
    and set flags (the quantum in ms) their values."""
    from alchemist.cli import _online_config, build_parser
    from alchemist.config import OnlineConfig

    parser = build_parser()
    assert _online_config(parser.parse_args(["serve"])) == OnlineConfig()
    args = parser.parse_args(["serve", "--train-group-size", "2", "--train-group-max-tokens", "0",
                              "--train-quantum-ms", "40", "--no-train", "--train-no-replay"])  # fmt: skip
    got = _online_config(args)
    assert (got.group_size, got.group_max_tokens, got.train_quantum_s) == (2, 0, 0.04)
    assert not got.enabled and not got.replay


def test_serve_prefix_caching_flag():
    from alchemist.cli import _engine_config, build_parser

    parser = build_parser()
    assert _engine_config(parser.parse_args(["serve"])).enable_prefix_caching
    assert not _engine_config(parser.parse_args(["serve", "--no-enable-prefix-caching"])).enable_prefix_caching
