"""Architecture of a Llama-family decoder, parsed from a Hugging Face ``config.json``.

Covers Llama 2 / 3.x (with the llama3 RoPE scaling), Mistral, Qwen2 / Qwen2.5 (q/k/v bias) and SmolLM / SmolLM2:
they differ only in the fields below.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
REQUIRED_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)


class ConfigError(ValueError):
    """A model configuration that cannot be used; the message names the file and the problem."""


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    model_type: str = "llama"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf(cls, hf: dict[str, Any], source: str | Path = "config.json") -> ModelConfig:
        """Builds the config from a parsed HF config.json; ``source`` names the file in errors."""
        model_type = hf.get("model_type")
        if model_type is None:
            raise ConfigError(f"{source}: missing required field 'model_type'")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"{source}: unsupported architecture model_type={model_type!r} "
                f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        missing = [k for k in REQUIRED_FIELDS if k not in hf]
        if missing:
            raise ConfigError(f"{source}: missing required field(s) {', '.join(map(repr, missing))}")
        num_heads = int(hf["num_attention_heads"])
        head_dim = hf.get("head_dim") or int(hf["hidden_size"]) // num_heads
        rope_scaling = hf.get("rope_scaling")
        rope_theta = hf.get("rope_theta")
        rope_parameters = hf.get("rope_parameters")  # transformers >= 5 folds theta and scaling in here
        if isinstance(rope_parameters, dict):
            rope_theta = rope_theta or rope_parameters.get("rope_theta")
            if rope_scaling is None and rope_parameters.get("rope_type", "default") != "default":
                rope_scaling = dict(rope_parameters)
        if rope_scaling is not None:
            kind = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
            if kind == "default":
                rope_scaling = None
            elif kind != "llama3":
                raise ConfigError(f"{source}: unsupported rope_scaling type {kind!r} (supported: llama3)")
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta or 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", model_type == "qwen2")),
            model_type=model_type,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )
