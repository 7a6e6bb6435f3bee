"""Saving and loading LoRA adapters in PEFT's on-disk format, so that PEFT and vLLM load what we write.

An adapter directory holds ``adapter_config.json`` (PEFT's ``LoraConfig``), ``adapter_model.safetensors`` (fp32,
keys like ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``) and our own ``alchemist.json``
(the adapter version; kept out of the PEFT config so that strict readers never see an unknown key).

    save_adapter(adapter, Path("adapters/latest"), base_model_name_or_path="HuggingFaceTB/SmolLM2-135M-Instruct")
    adapter = load_adapter(Path("adapters/latest"), model.config)

``load_adapter`` also reads adapters trained by PEFT itself for a Llama-family model. It rejects what our adapter
cannot express (bias, DoRA, modules_to_save, per-module ranks, ...); rsLoRA is read as the equivalent alpha.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from alchemist.model.config import ModelConfig
from alchemist.model.lora import ALL_TARGETS, LoraAdapter, LoraConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
VERSION_FILE = "alchemist.json"
# What an adapter directory may hold: save_adapter refuses to replace a directory holding anything else.
ADAPTER_FILES = {CONFIG_FILE, WEIGHTS_FILE, VERSION_FILE, "README.md", "adapter_model.bin"}
PARENT_MODULE = {m: "self_attn" if m in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp" for m in ALL_TARGETS}
# PEFT's LoRA weight keys; a model saved without its causal-LM head wrapper lacks the inner "model.".
KEY_PATTERN = re.compile(r"base_model\.model\.(?:model\.)?layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")
# LoraConfig fields that change what the weights mean; any truthy value is rejected.
UNSUPPORTED_FIELDS = (
    "use_dora",
    "modules_to_save",
    "fan_in_fan_out",
    "lora_bias",
    "rank_pattern",
    "alpha_pattern",
    "layers_to_transform",
    "layer_replication",
    "target_parameters",
    "trainable_token_indices",
    "alora_invocation_tokens",
    "use_qalora",
    "use_bdlora",
)

TensorKey = tuple[int, str, str]  # (layer, PEFT module, "A" | "B")


def peft_key(layer: int, module: str, which: str) -> str:
    return f"base_model.model.model.layers.{layer}.{PARENT_MODULE[module]}.{module}.lora_{which}.weight"


# --- saving -------------------------------------------------------------------------------------------------------


def peft_config(adapter: LoraAdapter, base_model_name_or_path: str | None) -> dict[str, Any]:
    c = adapter.config
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": c.r,
        "lora_alpha": int(c.alpha) if float(c.alpha).is_integer() else c.alpha,
        "target_modules": [m for m in ALL_TARGETS if m in c.target_modules],
        "lora_dropout": 0.0,
        "bias": "none",
        "modules_to_save": None,
        "use_dora": False,
        "use_rslora": False,
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "base_model_name_or_path": base_model_name_or_path,
        "inference_mode": True,
    }


def save_adapter(adapter: LoraAdapter, directory: Path, base_model_name_or_path: str | None = None) -> None:
    """Writes the adapter as a PEFT adapter directory, replacing ``directory`` atomically if it exists."""
    directory = Path(directory)
    check_replaceable(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", suffix=".tmp", dir=directory.parent))
    try:
        tensors = {
            peft_key(*key): t.detach().to("cpu", torch.float32).clone(memory_format=torch.contiguous_format)
            for key, t in adapter.module_tensors().items()
        }
        save_file(tensors, tmp / WEIGHTS_FILE, metadata={"format": "pt"})
        write_json(tmp / CONFIG_FILE, peft_config(adapter, base_model_name_or_path))
        write_json(tmp / VERSION_FILE, {"version": adapter.version})
        for name in (WEIGHTS_FILE, CONFIG_FILE, VERSION_FILE):
            fsync_path(tmp / name)
        fsync_path(tmp)
        replace_dir(tmp, directory)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # after a swap it holds the old adapter


def check_replaceable(directory: Path) -> None:
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"{directory}: exists and is not a directory; choose another adapter directory")
    if directory.is_dir():
        foreign = sorted(p.name for p in directory.iterdir() if p.name not in ADAPTER_FILES)
        if foreign:
            raise ValueError(f"{directory}: holds non-adapter files ({foreign[0]}, ...); not replacing it")


def write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_dir(src: Path, dst: Path) -> None:
    """Moves the complete directory ``src`` to ``dst``; an old ``dst`` ends up at ``src``.

    Note: readers must never see a mix of old and new files. A fresh ``dst`` is one rename. An existing one is
    swapped in one step where the kernel can (renameat2 RENAME_EXCHANGE); elsewhere it is moved aside first, so
    a crash between the two renames leaves ``dst`` missing (and the old adapter complete at ``src``), never torn.
    """
    if not dst.exists():
        os.rename(src, dst)
    elif not exchange(src, dst):
        aside = src.with_name(src.name + ".old")
        os.rename(dst, aside)
        os.rename(src, dst)
        os.rename(aside, src)
    fsync_path(dst.parent)


def exchange(a: Path, b: Path) -> bool:
    """Atomically swaps two paths (Linux renameat2); False where unsupported."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


# --- loading ------------------------------------------------------------------------------------------------------


def load_adapter(directory: Path, model_config: ModelConfig, device: torch.device | str = "cpu") -> LoraAdapter:
    """Reads a PEFT LoRA adapter directory (ours or PEFT's) for the model; ValueError names the file and problem."""
    directory = Path(directory)
    r, alpha = read_lora_config(directory / CONFIG_FILE)
    weights_path = directory / WEIGHTS_FILE
    tensors = read_weights(weights_path, model_config)
    targets = tuple(m for m in ALL_TARGETS if any(key[1] == m for key in tensors))
    adapter = LoraAdapter(model_config, LoraConfig(r=r, alpha=alpha, target_modules=targets), device=device)
    expected = adapter.module_tensors()
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise ValueError(f"{weights_path}: lacks {len(missing)} tensor(s), e.g. {peft_key(*missing[0])}")
    for key, dst in expected.items():
        if tensors[key].shape != dst.shape:
            raise ValueError(
                f"{weights_path}: {peft_key(*key)} has shape {tuple(tensors[key].shape)}, expected "
                f"{tuple(dst.shape)} for r={r} on this model (is the adapter for another base model?)"
            )
    with torch.no_grad():
        for key, dst in expected.items():
            dst.copy_(tensors[key])
    adapter.version = read_version(directory / VERSION_FILE)
    return adapter


def read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ValueError(f"{path}: not found (expected a PEFT LoRA adapter directory)")
    try:
        obj = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return obj


def read_lora_config(path: Path) -> tuple[int, float]:
    """Validates a PEFT adapter_config.json -> (r, alpha) with our scaling alpha / r.

    lora_dropout is accepted and ignored: it is a training-time choice that leaves the weights' meaning unchanged.
    """
    raw = read_json(path)
    if raw.get("peft_type") != "LORA":
        raise ValueError(f"{path}: peft_type must be 'LORA' (got {raw.get('peft_type')!r})")
    if raw.get("bias", "none") != "none":
        raise ValueError(f"{path}: bias={raw['bias']!r} is not supported (only 'none')")
    for field in UNSUPPORTED_FIELDS:
        if raw.get(field):
            raise ValueError(f"{path}: {field}={raw[field]!r} is not supported")
    r, alpha = raw.get("r"), raw.get("lora_alpha")
    if not isinstance(r, int) or r <= 0:
        raise ValueError(f"{path}: r must be a positive integer (got {r!r})")
    if not isinstance(alpha, int | float):
        raise ValueError(f"{path}: lora_alpha must be a number (got {alpha!r})")
    if raw.get("use_rslora"):
        alpha = alpha * math.sqrt(r)  # rsLoRA scales by alpha / sqrt(r): the same as alpha * sqrt(r) / r
    return r, float(alpha)


def read_weights(path: Path, model_config: ModelConfig) -> dict[TensorKey, torch.Tensor]:
    """PEFT-named LoRA tensors -> {(layer, module, "A"|"B"): fp32 tensor}, rejecting any other key."""
    if not path.is_file():
        raise ValueError(f"{path}: not found (only safetensors adapters are supported)")
    out: dict[TensorKey, torch.Tensor] = {}
    try:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                out[parse_key(path, name, model_config)] = f.get_tensor(name).float()
    except SafetensorError as e:
        raise ValueError(f"{path}: corrupt or truncated safetensors file ({e})") from e
    if not out:
        raise ValueError(f"{path}: holds no LoRA tensors")
    return out


def parse_key(path: Path, name: str, model_config: ModelConfig) -> TensorKey:
    match = KEY_PATTERN.fullmatch(name)
    if match is None:
        raise ValueError(f"{path}: unsupported tensor {name!r} (only LoRA A/B of {', '.join(ALL_TARGETS)})")
    layer, parent, module, which = int(match[1]), match[2], match[3], match[4]
    if PARENT_MODULE.get(module) != parent:
        raise ValueError(f"{path}: unsupported LoRA target {parent}.{module} in {name!r}")
    if layer >= model_config.num_layers:
        raise ValueError(f"{path}: {name!r} is for layer {layer}; the model has {model_config.num_layers} layers")
    return layer, module, which


def read_version(path: Path) -> int:
    """The adapter version from alchemist.json; 0 for an adapter we did not write."""
    if not path.exists():
        return 0
    version = read_json(path).get("version")
    if not isinstance(version, int) or version < 0:
        raise ValueError(f"{path}: version must be a non-negative integer (got {version!r})")
    return version
