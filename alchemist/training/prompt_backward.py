"""The prompt rows' backward of one decoder layer, written out by hand from the layer's record.

This is one step of the replay walk (``alchemist.training.replay``). Rebuilding the layer's forward graph for
autograd would rerun every elementwise op of the forward (norms, RoPE, SiLU·mul, residuals, the full-width LoRA
sums) and keep their outputs, only for autograd to read a few of them back; that rebuild cost more than the base
matmuls replay skips at short prompts. Here the backward is spelled out instead:

- base linears: the input gradient ``grad @ W`` only (the base weights are frozen);
- LoRA deltas: ``LoraAdapter.backward`` (dA, dB accumulated, dx added in place);
- attention: the flash backward from the recorded output and log-sum-exp (never the forward);
- RMSNorm, RoPE (a rotation by the opposite angle), SiLU·mul: their textbook backward.

Only the forward values the backward reads are recomputed: the normed inputs, the LoRA down-projections, q (with
its LoRA delta, RoPE'd), o and gate/up with their deltas, and the SiLU·mul product. The gradients equal
autograd's through the recompute path up to rounding (tests/training/test_replay.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from alchemist.model.attention import lse_dtype
from alchemist.model.llama import Llama, rms_norm
from alchemist.model.lora import LoraAdapter
from alchemist.model.rope import Rotation, apply_rotary

_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


class PromptRecord:
    """One layer's record, its first ``num_rows`` rows, each tensor cast to the compute dtype on first use."""

    def __init__(self, layer_record: dict[str, torch.Tensor], num_rows: int, dtype: torch.dtype) -> None:
        self.source = layer_record
        self.num_rows = num_rows
        self.dtype = dtype
        self.cache: dict[str, torch.Tensor] = {}

    def rows(self, name: str) -> torch.Tensor:
        """The recorded rows as stored (the record's own memory, in the record's dtype: read them, never write)."""
        return self.source[name][: self.num_rows]

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.cache:
            dtype = lse_dtype(self.dtype) if name == "lse" else self.dtype
            # .to() returns the record's own rows when the dtype already matches: read them, never write them.
            self.cache[name] = self.rows(name).to(dtype)
        return self.cache[name]


def prompt_kv(
    model: Llama, adapter: LoraAdapter, layer: int, rec: PromptRecord, rot: Rotation
) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompt rows' keys (RoPE'd) and values, (n, Hkv, Dh) each, as the forward computed them: recorded base
    outputs plus the live LoRA delta on the recorded layer input. Fresh tensors (the caller makes them leaves)."""
    c = model.config
    with torch.no_grad():
        xa = adapter.down(layer, "qkv", rms_norm(rec["h"], model.layers[layer].input_norm, c.rms_norm_eps))
        kv = rec.rows("qkv")[:, c.q_size :]
        kv = kv.to(rec.dtype, copy=True) if xa is None else adapter.add_up(layer, "qkv", kv, xa, ("k_proj", "v_proj"))
        k, v = kv.split([c.kv_size, c.kv_size], dim=-1)
        return apply_rotary(k.view(-1, c.num_kv_heads, c.head_dim), rot), v.view(-1, c.num_kv_heads, c.head_dim)


@torch.no_grad()
def prompt_layer_backward(
    model: Llama,
    adapter: LoraAdapter,
    layer: int,
    rec: PromptRecord,
    rot: Rotation,
    k: torch.Tensor,
    v: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    dh_out: torch.Tensor | None,
) -> torch.Tensor | None:
    """Backward of layer ``layer`` over the prompt rows 0..n-1; accumulates the adapter's gradients.

    k, v (n, Hkv, Dh): the rows' keys (RoPE'd) and values from ``prompt_kv``; dk, dv: their gradients from the live
    rows' attention. dh_out (n, d): the gradient of the layer's output rows, None at the top layer (its prompt
    outputs feed nothing: only its k and v matter there). Returns the gradient of the layer's input rows (None for
    layer 0, whose input is the frozen embedding).
    """
    c, mod = model.config, model.layers[layer]
    n, heads, head_dim = k.shape[0], c.num_heads, c.head_dim
    h_in = rec["h"]
    x1, xn1, rstd1 = _rms_norm(h_in, mod.input_norm, c.rms_norm_eps)
    xa_qkv = adapter.down(layer, "qkv", x1)

    d_qkv = h_in.new_empty(n, c.q_size + 2 * c.kv_size)  # dL/d(q, k, v before RoPE), filled part by part
    dq_pre, dk_pre, dv_pre = (t.view(n, -1, head_dim) for t in d_qkv.split([c.q_size, c.kv_size, c.kv_size], -1))
    dh_mid = None
    if dh_out is None:
        dq_pre.zero_()
        dk_pre.copy_(_rope_backward(dk, rot))
        dv_pre.copy_(dv)
    else:
        attn = rec["attn"]  # (n, H*Dh)
        xa_o = adapter.down(layer, "o", attn)
        o = rec["o"] if xa_o is None else adapter.add_up(layer, "o", rec.rows("o"), xa_o)
        dh_mid = _mlp_backward(model, adapter, layer, rec, h_in + o, dh_out).add_(dh_out)
        d_attn = dh_mid @ mod.o_weight
        if xa_o is not None:
            adapter.backward(layer, "o", attn, xa_o, dh_mid, d_attn)

        q_rows = rec.rows("qkv")[:, : c.q_size]
        q = q_rows.to(rec.dtype) if xa_qkv is None else adapter.add_up(layer, "qkv", q_rows, xa_qkv, ("q_proj",))
        q = apply_rotary(q.view(n, heads, head_dim), rot)
        dq, dk_attn, dv_attn = _flash_backward(
            _heads_first(d_attn.view(n, heads, head_dim)).contiguous(),
            _heads_first(q),
            _heads_first(k),
            _heads_first(v),
            _heads_first(attn.view(n, heads, head_dim)).contiguous(),
            rec["lse"].t().unsqueeze(0).contiguous(),  # (1, H, n)
            0.0,
            True,
            scale=head_dim**-0.5,
        )
        dq_pre.copy_(_rope_backward(_rows_first(dq), rot))
        dk_pre.copy_(_rope_backward(_rows_first(dk_attn).add_(dk), rot))
        torch.add(_rows_first(dv_attn), dv, out=dv_pre)

    if layer == 0:  # the embedding is frozen: only the adapter's gradients are wanted
        if xa_qkv is not None:
            adapter.backward(layer, "qkv", x1, xa_qkv, d_qkv, None)
        return None
    d_x1 = d_qkv @ mod.qkv_weight
    if xa_qkv is not None:
        adapter.backward(layer, "qkv", x1, xa_qkv, d_qkv, d_x1)
    dh_in = _rms_norm_backward(d_x1, xn1, rstd1, mod.input_norm)
    return dh_in if dh_mid is None else dh_in.add_(dh_mid)


def _mlp_backward(
    model: Llama, adapter: LoraAdapter, layer: int, rec: PromptRecord, h_mid: torch.Tensor, grad: torch.Tensor
) -> torch.Tensor:
    """dL/dh_mid through the MLP branch (norm, gate/up, SiLU·mul, down) of ``h_out = h_mid + mlp(h_mid)``,
    given grad = dL/dh_out; the residual's share is the caller's."""
    mod = model.layers[layer]
    x2, xn2, rstd2 = _rms_norm(h_mid, mod.post_norm, model.config.rms_norm_eps)
    xa_gu = adapter.down(layer, "gate_up", x2)
    gate_up = rec["gate_up"] if xa_gu is None else adapter.add_up(layer, "gate_up", rec.rows("gate_up"), xa_gu)
    gate, up = gate_up.chunk(2, dim=-1)
    silu = F.silu(gate)
    act = silu * up  # the down projection's input
    xa_down = adapter.down(layer, "down", act)

    d_act = grad @ mod.down_weight
    if xa_down is not None:
        adapter.backward(layer, "down", act, xa_down, grad, d_act)
    d_gate_up = torch.empty_like(gate_up)
    d_gate, d_up = d_gate_up.chunk(2, dim=-1)
    torch.mul(d_act, silu, out=d_up)
    d_gate.copy_(torch.ops.aten.silu_backward(d_act.mul_(up), gate))
    d_x2 = d_gate_up @ mod.gate_up_weight
    if xa_gu is not None:
        adapter.backward(layer, "gate_up", x2, xa_gu, d_gate_up, d_x2)
    return _rms_norm_backward(d_x2, xn2, rstd2, mod.post_norm)


def _rms_norm(h: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``rms_norm(h)`` computed as the model does, plus what its backward reads: the normalized rows and 1/rms,
    in (at least) fp32."""
    hf = h.to(torch.promote_types(h.dtype, torch.float32))
    rstd = torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    xn = hf * rstd
    return weight * xn.to(h.dtype), xn, rstd


def _rms_norm_backward(grad: torch.Tensor, xn: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """dL/dh of ``weight * h / rms(h)``: rstd * (g - xn * mean(g * xn)) with g = grad * weight."""
    g = (grad * weight).to(xn.dtype)
    return (rstd * (g - xn * (g * xn).mean(-1, keepdim=True))).to(grad.dtype)


def _rope_backward(grad: torch.Tensor, rot: Rotation) -> torch.Tensor:
    """RoPE is a rotation per pair of dimensions: its backward rotates by the opposite angle."""
    return apply_rotary(grad, Rotation(rot.cos, -rot.sin))


def _heads_first(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(0, 1).unsqueeze(0)  # (n, heads, Dh) -> (1, heads, n, Dh)


def _rows_first(t: torch.Tensor) -> torch.Tensor:
    return t[0].transpose(0, 1)  # (1, heads, n, Dh) -> (n, heads, Dh)
