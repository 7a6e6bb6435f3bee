"""Bad sampling parameters and engine settings raise ValueError naming the field."""

from __future__ import annotations

import pytest

from alchemist.config import EngineConfig
from alchemist.engine import SamplingParams


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_tokens", 0),
        ("max_tokens", 1.5),
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("temperature", "hot"),
        ("top_p", 0.0),
        ("top_p", 1.1),
        ("top_k", -1),
        ("seed", 1.0),
        ("stop", [""]),
        ("stop", [1]),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", "2"),
        ("ignore_eos", 1),
        ("logprobs", -1),
        ("logprobs", 21),
        ("record", "yes"),
    ],
)
def test_bad_sampling_params(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_sampling_params_normalise():
    p = SamplingParams(stop="###", stop_token_ids=(3, 4), seed=-5)
    assert p.stop == ["###"] and p.stop_token_ids == [3, 4] and not p.is_greedy
    assert SamplingParams(temperature=0).is_greedy


@pytest.mark.parametrize(
    "field, value",
    [
        ("dtype", "float16"),
        ("device", "tpu"),
        ("max_num_seqs", 0),
        ("max_model_len", -1),
        ("block_size", 0),
        ("num_kv_blocks", 0),
        ("max_num_batched_tokens", 2.5),
        ("max_waiting", 0),
        ("enable_prefix_caching", 1),
        ("compile_decode", "yes"),
    ],
)
def test_bad_engine_config(field, value):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: value})


def test_engine_config_cross_checks():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineConfig(max_num_seqs=64, max_num_batched_tokens=32)
    with pytest.raises(ValueError, match="max_model_len"):
        EngineConfig(max_model_len=9000).resolve(max_position_embeddings=8192)
    resolved = EngineConfig(max_num_seqs=4, block_size=16).resolve(max_position_embeddings=8192)
    assert resolved.max_model_len == 4096 and resolved.num_kv_blocks == 4 * 256
