"""Loading errors name the file and the problem."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from alchemist.model.config import ConfigError
from alchemist.model.loader import LoadError, build_model, hf_dir_for, load_model


def test_missing_path(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        load_model(missing)


def test_unsupported_architecture(tiny_dirs, tmp_path):
    d = shutil.copytree(tiny_dirs["llama-gqa-untied"], tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"config\.json.*unsupported architecture.*'gpt2'"):
        build_model(d, dtype=torch.float32)


@pytest.mark.parametrize("field", ["hidden_size", "num_hidden_layers", "model_type"])
def test_config_without_required_field(tiny_dirs, tmp_path, field):
    d = shutil.copytree(tiny_dirs["llama-gqa-untied"], tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    del cfg[field]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=rf"config\.json.*missing required field.*'{field}'"):
        build_model(d, dtype=torch.float32)


@pytest.mark.parametrize("keep_fraction", [0.0001, 0.5])  # cut in the header, and in the tensor data
def test_truncated_safetensors(tiny_dirs, tmp_path, keep_fraction):
    d = shutil.copytree(tiny_dirs["llama-gqa-untied"], tmp_path / "m")
    weights = d / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: max(8, int(len(data) * keep_fraction))])
    with pytest.raises(LoadError, match=rf"{weights}.*corrupt or truncated"):
        build_model(d, dtype=torch.float32)


def test_missing_tensor(tiny_dirs, tmp_path):
    from safetensors.torch import load_file, save_file

    d = shutil.copytree(tiny_dirs["llama-gqa-untied"], tmp_path / "m")
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(LoadError, match=r"lacks 1 tensor.*model\.layers\.1\.mlp\.up_proj\.weight"):
        build_model(d, dtype=torch.float32)


def test_not_a_model(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"x")
    with pytest.raises(LoadError, match=r"weights\.bin.*expected a \.gguf"):
        hf_dir_for(f)
    with pytest.raises(LoadError, match=r"no config\.json"):
        build_model(tmp_path, dtype=torch.float32)
