"""LoRA adapters on the fused base projections, with PEFT's module names, scaling and initialisation.

The model fuses q/k/v into ``qkv`` and gate/up into ``gate_up``; an adapter keeps one A matrix per fused group
(the targeted parts' A stacked: one matmul for the down-projection) and one B per part. ``delta(layer, "qkv", x)``
returns the concatenated per-part deltas (zeros for parts that are not targeted), scaled by alpha / r.

Weights are fp32 masters; the delta is computed in the input's dtype. The on-disk format is PEFT's
(``alchemist.model.peft_format``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from alchemist.model.config import ModelConfig

# Rows out of the cut ranks' scope (``LoraAdapter.cut``): the first n, those a (T,) bool mask marks, or none.
Rows = int | torch.Tensor | None

# Fused seam name -> the PEFT target modules it holds, in row order of the fused weight.
FUSED_PARTS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
ALL_TARGETS = tuple(part for parts in FUSED_PARTS.values() for part in parts)
PART_TO_FUSED = {part: fused for fused, parts in FUSED_PARTS.items() for part in parts}


@dataclass(frozen=True)
class LoraConfig:
    r: int = 16
    alpha: float = 32.0
    target_modules: tuple[str, ...] = ALL_TARGETS
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if self.r <= 0:
            raise ValueError(f"lora r must be positive (got {self.r})")
        unknown = set(self.target_modules) - set(ALL_TARGETS)
        if unknown or not self.target_modules:
            raise ValueError(f"lora target_modules must be a non-empty subset of {ALL_TARGETS} (got {unknown})")
        if self.dropout != 0.0:
            raise ValueError("lora dropout is not supported (exact replay needs a deterministic adapter)")

    @property
    def scaling(self) -> float:
        return self.alpha / self.r


def part_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """PEFT module -> (in_features, out_features) of its base linear."""
    d, i, q, kv = config.hidden_size, config.intermediate_size, config.q_size, config.kv_size
    return {
        "q_proj": (d, q),
        "k_proj": (d, kv),
        "v_proj": (d, kv),
        "o_proj": (q, d),
        "gate_proj": (d, i),
        "up_proj": (d, i),
        "down_proj": (i, d),
    }


class LoraAdapter(nn.Module):
    """Per layer and fused group: ``A`` (parts*r, in) and one ``B`` (out, r) per targeted part."""

    def __init__(
        self,
        model_config: ModelConfig,
        config: LoraConfig | None = None,
        device: torch.device | str = "cpu",
        seed: int | None = None,
    ) -> None:
        super().__init__()
        self.config = config or LoraConfig()
        self.model_config = model_config
        self.shapes = part_shapes(model_config)
        self.version = 0
        # The first ``cut`` ranks of each part act only on the rows a call leaves in scope (its ``unscoped``
        # argument: the others); 0, every rank on every row. alchemist.training.rank_split sets it.
        self.cut = 0
        self.taught: list[list[int]] = []  # the prompts (token ids) the cut ranks were taught on: where they serve
        gen = torch.Generator(device="cpu").manual_seed(seed) if seed is not None else None
        r = self.config.r
        self.A = nn.ParameterDict()
        self.B = nn.ParameterDict()
        for layer in range(model_config.num_layers):
            for fused, parts in FUSED_PARTS.items():
                targeted = self.targeted(fused)
                if not targeted:
                    continue
                in_features = self.shapes[parts[0]][0]
                a = torch.empty(len(targeted) * r, in_features)
                for j in range(len(targeted)):  # PEFT: kaiming-uniform A per module, B zero
                    nn.init.kaiming_uniform_(a[j * r : (j + 1) * r], a=math.sqrt(5), generator=gen)
                self.A[f"{layer}_{fused}"] = nn.Parameter(a.to(device))
                for part in targeted:
                    self.B[f"{layer}_{part}"] = nn.Parameter(torch.zeros(self.shapes[part][1], r, device=device))

    def targeted(self, fused: str) -> tuple[str, ...]:
        return tuple(p for p in FUSED_PARTS[fused] if p in self.config.target_modules)

    def delta(self, layer: int, name: str, x: torch.Tensor, unscoped: Rows = None) -> torch.Tensor | None:
        """Low-rank delta for the fused projection ``name`` on input x (T, in) -> (T, fused out)."""
        xa = self.down(layer, name, x, unscoped)
        return None if xa is None else self.up(layer, name, xa)

    def down(self, layer: int, name: str, x: torch.Tensor, unscoped: Rows = None) -> torch.Tensor | None:
        """The scaled down-projection ``scaling * x @ A^T`` (T, parts*r) of the targeted parts, the cut ranks'
        columns zero on the ``unscoped`` rows; None if none."""
        if not self.targeted(name):
            return None
        # Scaling the (T, parts*r) down-projection rather than each (T, out) delta: one small elementwise pass.
        return self.scoped((x @ self.A[f"{layer}_{name}"].to(x.dtype).t()) * self.config.scaling, unscoped)

    def scoped(self, xa: torch.Tensor, unscoped: Rows) -> torch.Tensor:
        """``xa`` (T, parts*r), or a gradient of it, with the cut ranks' columns zero on the ``unscoped`` rows (the
        first that many, or those a (T,) bool mask marks): a new tensor, or ``xa`` where nothing is cut."""
        if not self.cut or unscoped is None or (isinstance(unscoped, int) and unscoped == 0):
            return xa
        r = self.config.r
        keep = torch.ones(xa.shape[0], xa.shape[1] // r, r, dtype=xa.dtype, device=xa.device)
        if isinstance(unscoped, int):
            keep[:unscoped, :, : self.cut] = 0
        else:
            keep[unscoped, :, : self.cut] = 0
        return xa * keep.view_as(xa)

    def up(self, layer: int, name: str, xa: torch.Tensor, parts: tuple[str, ...] | None = None) -> torch.Tensor:
        """The deltas of ``parts`` (default: all of the fused projection's), concatenated: (T, their out)."""
        targeted, r = self.targeted(name), self.config.r
        outs = []
        for part in parts or FUSED_PARTS[name]:
            if part in targeted:
                j = targeted.index(part)
                outs.append(xa[:, j * r : (j + 1) * r] @ self.B[f"{layer}_{part}"].to(xa.dtype).t())
            else:
                outs.append(xa.new_zeros(xa.shape[0], self.shapes[part][1]))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)

    def add_up_(
        self, layer: int, name: str, out: torch.Tensor, xa: torch.Tensor, parts: tuple[str, ...] | None = None
    ) -> torch.Tensor:
        """``out += up(layer, name, xa, parts)`` in place, without materializing the deltas: one addmm per
        targeted part into its columns of ``out`` (the outputs of exactly ``parts``' columns, in xa's dtype);
        returns ``out``. The replay walk rebuilds recorded outputs so, the record copied into ``out`` first. In
        fp32 bitwise the sum; in bf16 it rounds once where the sum rounds twice (tests/model/test_lora.py)."""
        targeted, r, col = self.targeted(name), self.config.r, 0
        for part in parts or FUSED_PARTS[name]:
            width = self.shapes[part][1]
            if part in targeted:
                j = targeted.index(part)
                out[:, col : col + width].addmm_(xa[:, j * r : (j + 1) * r], self.B[f"{layer}_{part}"].to(xa.dtype).t())
            col += width
        return out

    @torch.no_grad()
    def backward(
        self,
        layer: int,
        name: str,
        x: torch.Tensor,
        xa: torch.Tensor,
        grad: torch.Tensor,
        dx: torch.Tensor | None,
        unscoped: Rows = None,
    ) -> None:
        """The delta's backward by hand, for the replay walk (no autograd graph).

        ``grad`` (T, fused out) is dL/d(delta) of ``delta(layer, name, x, unscoped)``, ``xa = down(layer, name, x,
        unscoped)``.
        Accumulates dL/dA and dL/dB into the parameters' ``.grad``; adds dL/dx into ``dx`` (T, in) in place
        (pass None where x needs no gradient).
        """
        targeted, r, scaling = self.targeted(name), self.config.r, self.config.scaling
        pieces, col = [], 0  # dL/d(xa), per targeted part: (T, r) each
        for part in FUSED_PARTS[name]:
            width = self.shapes[part][1]
            if part in targeted:
                j = targeted.index(part)
                g, b = grad[:, col : col + width], self.B[f"{layer}_{part}"]
                _accumulate_grad(b, g.t() @ xa[:, j * r : (j + 1) * r])
                pieces.append(g @ b.to(g.dtype))
            col += width
        dxa = self.scoped((pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=-1)).mul_(scaling), unscoped)
        a = self.A[f"{layer}_{name}"]
        _accumulate_grad(a, dxa.t() @ x)
        if dx is not None:
            dx.addmm_(dxa, a.to(dx.dtype))

    # --- per-module views, in PEFT's naming (for saving, loading and comparing gradients) ------------------------

    def module_tensors(self, grads: bool = False) -> dict[tuple[int, str, str], torch.Tensor]:
        """(layer, module, "A"|"B") -> the weight (or its gradient) of that PEFT module, as views."""
        r = self.config.r
        out: dict[tuple[int, str, str], torch.Tensor] = {}
        for layer in range(self.model_config.num_layers):
            for fused in FUSED_PARTS:
                for j, part in enumerate(self.targeted(fused)):
                    a, b = self.A[f"{layer}_{fused}"], self.B[f"{layer}_{part}"]
                    if grads:
                        a, b = a.grad, b.grad
                    out[(layer, part, "A")] = None if a is None else a[j * r : (j + 1) * r]
                    out[(layer, part, "B")] = b
        return out


def _accumulate_grad(param: torch.Tensor, grad: torch.Tensor) -> None:
    """``param.grad += grad`` (fp32 masters), as autograd's accumulation would."""
    if param.grad is None:
        param.grad = grad.to(param.dtype, copy=True).contiguous()
    else:
        param.grad += grad
