"""Tiny random Llama-family checkpoints saved as real HF directories (fast exactness tests)."""

from __future__ import annotations

from pathlib import Path

import torch

TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
)

# name -> (transformers config class name, overrides). Together they cover GQA, tied and untied embeddings,
# q/k/v bias and the llama3 RoPE scaling.
TINY_VARIANTS = {
    "llama-gqa-untied": ("LlamaConfig", dict(num_key_value_heads=2, tie_word_embeddings=False)),
    "llama-mha-tied": ("LlamaConfig", dict(num_key_value_heads=4, tie_word_embeddings=True)),
    "llama3-rope-scaling": (
        "LlamaConfig",
        dict(
            num_key_value_heads=1,
            rope_theta=500000.0,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
        ),
    ),
    "qwen2-bias": ("Qwen2Config", dict(num_key_value_heads=2, tie_word_embeddings=True)),
    "mistral": ("MistralConfig", dict(num_key_value_heads=2, sliding_window=None)),
}


def make_tiny_hf_dir(root: Path, variant: str, seed: int = 0) -> Path:
    """Saves a randomly initialised transformers model of the variant to ``root/variant`` (safetensors)."""
    import transformers

    cls_name, overrides = TINY_VARIANTS[variant]
    config = getattr(transformers, cls_name)(**TINY, **overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    with torch.no_grad():  # random norms and biases, so a wrong mapping cannot hide behind ones and zeros
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0, 0.1)
    out = root / variant
    model.save_pretrained(out, safe_serialization=True)
    return out


def make_tiny_chat_dir(root: Path, seed: int = 0) -> Path:
    """A tiny random Llama with the default model's tokenizer and chat template (its vocabulary, so ShareGPT text
    encodes to valid ids), saved to ``root/tiny-chat``: what a benchmark that serves chat requests needs, in
    seconds rather than the real model's minutes."""
    import shutil

    import transformers

    from alchemist.model.loader import hf_dir_for

    source = hf_dir_for(None)
    out = root / "tiny-chat"
    out.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (source / name).exists():
            shutil.copy(source / name, out / name)
    vocab_size = transformers.AutoConfig.from_pretrained(source).vocab_size
    config = transformers.LlamaConfig(
        **{**TINY, "vocab_size": vocab_size, "max_position_embeddings": 2048},
        num_key_value_heads=2, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    return out
