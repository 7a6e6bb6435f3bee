"""A Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM) as plain PyTorch math.

No I/O here: weights arrive through ``alchemist.model.loader``; the KV cache rides in the attention metadata; the
LoRA adapter and the ops seam (compute / record / replay) are passed in. The layer is split into the functions
the replay trainer composes: ``attention_inputs`` (norm, fused q/k/v, RoPE), ``attention_output`` (attention,
o-projection, residual) and ``mlp`` (norm, fused gate/up, SwiGLU, down, residual).

Tokens are flattened: hidden states are ``(T, hidden)`` for T tokens of possibly many sequences.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from alchemist.model.attention import AttentionMetadata
from alchemist.model.config import ModelConfig
from alchemist.model.rope import RotaryEmbedding, Rotation, apply_rotary
from alchemist.model.seam import COMPUTE, Ops


class Adapter(Protocol):
    """A low-rank delta on a fused base projection (``alchemist.model.lora``); None where it has none."""

    def delta(self, layer: int, name: str, x: torch.Tensor) -> torch.Tensor | None: ...


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalize in (at least) fp32 and cast back before the weight, as the reference implementation does.
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        d, i = config.hidden_size, config.intermediate_size
        qkv_out = config.q_size + 2 * config.kv_size

        def param(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)

        self.input_norm = param(d)
        self.qkv_weight = param(qkv_out, d)
        self.qkv_bias = param(qkv_out) if config.attention_bias else None
        self.o_weight = param(d, config.q_size)
        self.post_norm = param(d)
        self.gate_up_weight = param(2 * i, d)
        self.down_weight = param(d, i)


class Llama(nn.Module):
    def __init__(
        self, config: ModelConfig, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
    ) -> None:
        super().__init__()
        self.config = config
        d, vocab = config.hidden_size, config.vocab_size
        self.embed = nn.Parameter(torch.empty(vocab, d, dtype=dtype, device=device), requires_grad=False)
        self.layers = nn.ModuleList(DecoderLayer(config, dtype, device) for _ in range(config.num_layers))
        self.norm = nn.Parameter(torch.empty(d, dtype=dtype, device=device), requires_grad=False)
        self.lm_head = (
            self.embed
            if config.tie_word_embeddings
            else nn.Parameter(torch.empty(vocab, d, dtype=dtype, device=device), requires_grad=False)
        )
        self.rope = RotaryEmbedding(config, device=device)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device

    # --- the layer, in the pieces the replay trainer composes -------------------------------------------------

    def project(self, layer: int, name: str, x: torch.Tensor, ops: Ops, adapter: Adapter | None) -> torch.Tensor:
        """A fused base projection through the seam, plus the adapter's live low-rank delta."""
        mod = self.layers[layer]
        weight = getattr(mod, f"{name}_weight")
        bias = getattr(mod, f"{name}_bias", None)
        y = ops.linear(layer, name, x, weight, bias)
        if adapter is not None and (delta := adapter.delta(layer, name, x)) is not None:
            y = y + delta
        return y

    def attention_inputs(
        self, layer: int, h: torch.Tensor, rot: Rotation, ops: Ops, adapter: Adapter | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(T, d) -> q (T, H, Dh), k and v (T, Hkv, Dh), RoPE applied to q and k."""
        c = self.config
        x = rms_norm(h, self.layers[layer].input_norm, c.rms_norm_eps)
        qkv = self.project(layer, "qkv", x, ops, adapter)
        q, k, v = qkv.split([c.q_size, c.kv_size, c.kv_size], dim=-1)
        q = q.view(-1, c.num_heads, c.head_dim)
        k = k.view(-1, c.num_kv_heads, c.head_dim)
        v = v.view(-1, c.num_kv_heads, c.head_dim)
        return apply_rotary(q, rot), apply_rotary(k, rot), v

    def attention_output(
        self, layer: int, h: torch.Tensor, attn: torch.Tensor, ops: Ops, adapter: Adapter | None
    ) -> torch.Tensor:
        """Residual add of the o-projection of the attention output (T, H, Dh)."""
        return h + self.project(layer, "o", attn.flatten(-2), ops, adapter)

    def mlp(self, layer: int, h: torch.Tensor, ops: Ops, adapter: Adapter | None) -> torch.Tensor:
        x = rms_norm(h, self.layers[layer].post_norm, self.config.rms_norm_eps)
        gate, up = self.project(layer, "gate_up", x, ops, adapter).chunk(2, dim=-1)
        return h + self.project(layer, "down", F.silu(gate) * up, ops, adapter)

    def layer_forward(
        self,
        layer: int,
        h: torch.Tensor,
        rot: Rotation,
        meta: AttentionMetadata,
        ops: Ops,
        adapter: Adapter | None,
    ) -> torch.Tensor:
        ops.layer_input(layer, h)
        q, k, v = self.attention_inputs(layer, h, rot, ops, adapter)
        h = self.attention_output(layer, h, ops.attention(layer, q, k, v, meta), ops, adapter)
        return self.mlp(layer, h, ops, adapter)

    # --- whole model --------------------------------------------------------------------------------------------

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        ops: Ops = COMPUTE,
        adapter: Adapter | None = None,
    ) -> torch.Tensor:
        """Flattened tokens (T,) at their absolute positions (T,) -> final hidden states (T, d), pre-norm."""
        return deque(self.forward_layers(input_ids, positions, meta, ops, adapter), maxlen=1).pop()

    def forward_layers(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        ops: Ops = COMPUTE,
        adapter: Adapter | None = None,
        between: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> Iterator[torch.Tensor]:
        """``forward`` one layer at a time: yields the hidden states after each layer (the last: the final ones),
        so that a caller can pause between layers (the online trainer's slices). ``between``, if given, maps a
        layer's output to the next layer's input (the layer-split recompute cuts the autograd graph there)."""
        h = F.embedding(input_ids, self.embed)
        rot = self.rope(positions, h.dtype, meta.max_position)
        for layer in range(self.config.num_layers):
            if layer and between is not None:
                h = between(h)
            h = self.layer_forward(layer, h, rot, meta, ops, adapter)
            yield h

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head on the rows given (only those whose next token is wanted)."""
        return F.linear(rms_norm(hidden, self.norm, self.config.rms_norm_eps), self.lm_head)
