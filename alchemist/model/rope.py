"""Rotary position embedding (half-split layout, as in the HF checkpoints), with the llama3 frequency scaling."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import nn

from alchemist.model.config import ModelConfig


def inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if config.rope_scaling is None:
        return inv_freq
    return _llama3_scaled(inv_freq, config.rope_scaling)


def _llama3_scaled(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1's long-context scaling: slow down low frequencies, keep high ones, blend in between."""
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class Rotation(NamedTuple):
    """cos and sin of each row's angles, (T, 1, Dh/2) in the compute dtype: computed once per forward."""

    cos: torch.Tensor
    sin: torch.Tensor

    def rows(self, start: int, stop: int | None = None) -> Rotation:
        """The rotation of rows start..stop-1."""
        return Rotation(self.cos[start:stop], self.sin[start:stop])


def apply_rotary(x: torch.Tensor, rot: Rotation) -> torch.Tensor:
    """x (T, heads, Dh). Half-split layout: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin).

    Bitwise the reference's ``x * cos + rotate_half(x) * sin`` (its cos and sin repeat each half; a - b is
    a + (-b) in IEEE arithmetic), with half the elementwise work and no negated copy.
    """
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * rot.cos - x2 * rot.sin, x2 * rot.cos + x1 * rot.sin), dim=-1)


def rotate_into(x: torch.Tensor, rot: Rotation, out: torch.Tensor, inverse: bool = False) -> None:
    """``apply_rotary(x, rot)`` written into ``out`` (bitwise the same: each product rounded, then summed; no
    temporary of the whole result), or with ``inverse`` the rotation by the opposite angle, which is RoPE's
    backward. x, out (T, heads, Dh)."""
    x1, x2 = x.chunk(2, dim=-1)
    out1, out2 = out.chunk(2, dim=-1)
    torch.mul(x1, rot.cos, out=out1)
    torch.mul(x2, rot.cos, out=out2)
    if inverse:  # (x1 cos + x2 sin, x2 cos - x1 sin)
        out1.add_(x2 * rot.sin)
        out2.sub_(x1 * rot.sin)
    else:  # (x1 cos - x2 sin, x2 cos + x1 sin)
        out1.sub_(x2 * rot.sin)
        out2.add_(x1 * rot.sin)


class RotaryEmbedding(nn.Module):
    """cos/sin tables computed in fp32 for positions 0..n-1 and grown on demand."""

    def __init__(self, config: ModelConfig, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.register_buffer("inv_freq", inverse_frequencies(config).to(device), persistent=False)
        self.register_buffer("cos", torch.empty(0, config.head_dim // 2, device=device), persistent=False)
        self.register_buffer("sin", torch.empty(0, config.head_dim // 2, device=device), persistent=False)

    def tables(self, num_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(n, Dh/2) fp32 cos and sin for positions 0..n-1, n >= num_positions."""
        if num_positions > self.cos.shape[0]:
            n = 1 << max(num_positions - 1, 255).bit_length()
            pos = torch.arange(n, dtype=torch.float32, device=self.inv_freq.device)
            freqs = pos[:, None] * self.inv_freq[None, :]  # one fp32 product each, as the reference computes them
            self.cos, self.sin = freqs.cos(), freqs.sin()
        return self.cos, self.sin

    def forward(self, positions: torch.Tensor, dtype: torch.dtype, max_position: int | None = None) -> Rotation:
        """The rotation for absolute ``positions`` (T,); pass ``max_position`` to spare a device sync."""
        if max_position is None:
            max_position = int(positions.max()) if positions.numel() else 0
        cos, sin = self.tables(max_position + 1)
        return Rotation(cos[positions].to(dtype).unsqueeze(1), sin[positions].to(dtype).unsqueeze(1))
