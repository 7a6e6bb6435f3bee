"""One decoder layer's backward over a replayed sequence, written out by hand: the step of the replay walk.

The rows are the prompt's first n (positions 0..P-2, their forward values from the record) followed by the R live
rows (P-1..P+R-2, their forward values kept by the live forward: ``LiveLayer``). Both go through one backward per
layer: each base weight is read once for n + R rows, and attention is one causal flash backward over all n + R
rows, as a recompute's backward would run it; the live rows need no autograd graph and no second pass of their own.

Rebuilding the layer's forward graph for autograd would rerun every elementwise op of the forward (norms, RoPE,
SiLU·mul, residuals, the full-width LoRA sums) and keep their outputs, only for autograd to read a few of them
back. Here the backward is spelled out instead:

- base linears: the input gradient ``grad @ W`` only (the base weights are frozen);
- LoRA deltas: ``LoraAdapter.backward`` (dA, dB accumulated, dx added in place);
- attention: the flash backward from the forward's output and log-sum-exp (never the forward);
- RMSNorm, RoPE (a rotation by the opposite angle), SiLU·mul: their textbook backward.

Only the forward values the backward reads are recomputed: the normed inputs, the LoRA down-projections, the prompt
rows' q (with its LoRA delta, RoPE'd), o and gate/up with their deltas, and the SiLU·mul product. The gradients
equal autograd's through the recompute path up to rounding (tests/training/test_replay.py).

Several samples walk together (``Packing``, in ``packing.py``): all their prompt rows first, sample by sample, then
all their live rows. Every op but attention works row by row, so it runs once over all the samples' rows (each weight
read once, each LoRA matmul one call); attention runs per sample on its rows, gathered.
"""

from __future__ import annotations

from collections.abc import Generator

import torch
import torch.nn.functional as F

from alchemist.model import flash
from alchemist.model.llama import Llama, rms_norm
from alchemist.model.lora import LoraAdapter
from alchemist.model.rope import Rotation, apply_rotary, rotate_into
from alchemist.training.live_attention import heads_first, live_attention_backward, rows_first
from alchemist.training.packing import LiveLayer, Packing, PromptRecord


def prompt_kv(
    model: Llama, adapter: LoraAdapter, layer: int, rec: PromptRecord, rot: Rotation
) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompt rows' keys (RoPE'd) and values, (n, Hkv, Dh) each, as the forward computed them: recorded base
    outputs plus the live LoRA delta on the recorded layer input (the cut ranks never act on prompt rows). Fresh
    tensors."""
    c = model.config
    with torch.no_grad():
        h = rec.read_rows("h")
        xa = adapter.down(layer, "qkv", rms_norm(h, model.layers[layer].input_norm, c.rms_norm_eps), h.shape[0])
        kv = rec.fresh_rows("qkv", slice(c.q_size, None))
        if xa is not None:  # the recorded base outputs plus the delta, in place
            adapter.add_up_(layer, "qkv", kv, xa, ("k_proj", "v_proj"))
        k, v = kv.split([c.kv_size, c.kv_size], dim=-1)
        return apply_rotary(k.view(-1, c.num_kv_heads, c.head_dim), rot), v.view(-1, c.num_kv_heads, c.head_dim)


@torch.no_grad()  # (on a generator: grad mode is off only while its body runs, not while it is paused)
def layer_backward_slices(
    model: Llama,
    adapter: LoraAdapter,
    layer: int,
    rec: PromptRecord,
    live: LiveLayer,
    rot: Rotation,
    dh_out: torch.Tensor,
    pack: Packing | None = None,
    in_scope: bool = True,
) -> Generator[None, None, torch.Tensor | None]:
    """Backward of layer ``layer`` over the n + R rows of the samples in ``pack`` (default: one sample, rows
    0..n+R-1); accumulates the adapter's gradients.

    rot: the rotation of the rows (in ``pack``'s order). dh_out: the gradient of the layer's output rows, (n + R, d),
    or (R, d) at the top layer, where only the live rows' outputs feed the loss (the prompt rows matter there
    through their keys and values only). Returns the gradient of the layer's input rows (n + R, d), None for layer
    0 (its input is the frozen embedding).

    In two slices (a generator): the MLP and the o-projection, then attention and the qkv projection; it yields
    once between them. A whole layer was the trainer's longest slice, and serving waits for the slice in progress;
    each half takes about half as long (docs/benchmarks.md, "Why the defaults", slices).

    The adapter's cut ranks (``LoraAdapter.cut``) act on the live rows where ``in_scope``, never on the prompt's."""
    c, mod = model.config, model.layers[layer]
    n, num_live = rec.num_rows, live.h.shape[0]
    pack = pack or Packing([n], [num_live])
    heads, head_dim = c.num_heads, c.head_dim
    top = n > 0 and dh_out.shape[0] == num_live  # the prompt rows' outputs carry no gradient
    h_in = _stack(rec, "h", live.h)
    x1, xn1, rstd1 = _rms_norm(h_in, mod.input_norm, c.rms_norm_eps)
    # rows out of the cut ranks' scope among [prompt rows ; live rows], or among the live rows alone at the top
    unscoped_all, unscoped_live = (n, 0) if in_scope else (n + num_live, num_live)
    xa_qkv = adapter.down(layer, "qkv", x1, unscoped_all)

    # The o-projection and the MLP, over the rows whose outputs carry gradient (the live rows only at the top).
    attn = live.attn if top else _stack(rec, "attn", live.attn)
    unscoped = unscoped_live if top else unscoped_all
    xa_o = adapter.down(layer, "o", attn, unscoped)
    if top:
        h_mid = live.h_mid
    else:
        h_mid = _after_live_rows(n, live.h_mid)  # the prompt rows' o, then h_in + o in place
        _rebuild(adapter, layer, "o", rec, xa_o, h_mid[:n])
        h_mid[:n] += h_in[:n]
    prompt_gate_up = None if top else rec
    dh_mid = _mlp_backward(model, adapter, layer, h_mid, prompt_gate_up, live.gate_up, dh_out, unscoped).add_(dh_out)
    d_attn = dh_mid @ mod.o_weight
    if xa_o is not None:
        adapter.backward(layer, "o", attn, xa_o, dh_mid, d_attn, unscoped)
    yield

    # Attention: the flash backward from the forward's output and lse.
    d_qkv = h_in.new_empty(n + num_live, c.q_size + 2 * c.kv_size)  # dL/d(q, k, v before RoPE), filled by parts
    dq_pre, dk_pre, dv_pre = (t.view(-1, t.shape[-1] // head_dim, head_dim) for t in d_qkv.split(
        [c.q_size, c.kv_size, c.kv_size], -1))  # fmt: skip
    d_out = d_attn.view(-1, heads, head_dim)
    if top:  # queries: the live rows only (``live_attention``'s backward), per sample
        out = live.attn.view(num_live, heads, head_dim)
        grads = [live_attention_backward(*(pack.live_rows(t, i) for t in (d_out, live.q)), live.k[i], live.v[i],
                                         *(pack.live_rows(t, i) for t in (out, live.lse)), pack.prompt[i])
                 for i in range(len(pack))]  # fmt: skip
        dq = grads[0][0] if len(pack) == 1 else torch.cat([g[0] for g in grads])
        dk, dv = pack.join([g[1] for g in grads]), pack.join([g[2] for g in grads])
        dq_pre[:n].zero_()
        rotate_into(dq, rot.rows(n), dq_pre[n:], inverse=True)
    else:  # one causal attention over each sample's n + R rows
        if xa_qkv is None:
            q_prompt = rec.read_rows("qkv", slice(0, c.q_size))
        else:  # the recorded base outputs plus the delta, in place
            q_prompt = rec.fresh_rows("qkv", slice(0, c.q_size))
            adapter.add_up_(layer, "qkv", q_prompt, xa_qkv[:n], ("q_proj",))
        q = _after_live_rows(n, live.q)
        rotate_into(q_prompt.view(n, heads, head_dim), rot.rows(0, n), q[:n])
        lse = _stack(rec, "lse", live.lse)  # (n + R, H)
        out = attn.view(-1, heads, head_dim)
        grads = []
        for i in range(len(pack)):
            d_out_i, q_i, out_i, lse_i = (pack.segment(t, i) for t in (d_out, q, out, lse))
            # The CPU flash kernels take and give (1, heads, rows, Dh) views of rows-first memory: no copies.
            grads.append([rows_first(t) for t in flash.backward(
                heads_first(d_out_i), heads_first(q_i), heads_first(live.k[i]), heads_first(live.v[i]),
                heads_first(out_i), lse_i.t().unsqueeze(0), causal=True, scale=head_dim**-0.5,
            )])  # fmt: skip
        dq, dk, dv = (pack.join([g[j] for g in grads]) for j in range(3))
        rotate_into(dq, rot, dq_pre, inverse=True)
    rotate_into(dk, rot, dk_pre, inverse=True)
    dv_pre.copy_(dv)

    if layer == 0:  # the embedding is frozen: only the adapter's gradients are wanted
        if xa_qkv is not None:
            adapter.backward(layer, "qkv", x1, xa_qkv, d_qkv, None, unscoped_all)
        return None
    d_x1 = d_qkv @ mod.qkv_weight
    if xa_qkv is not None:
        adapter.backward(layer, "qkv", x1, xa_qkv, d_qkv, d_x1, unscoped_all)
    dh_in = _rms_norm_backward(d_x1, xn1, rstd1, mod.input_norm)
    (dh_in[n:] if top else dh_in).add_(dh_mid)
    return dh_in


def _mlp_backward(
    model: Llama,
    adapter: LoraAdapter,
    layer: int,
    h_mid: torch.Tensor,
    rec: PromptRecord | None,
    live_gate_up: torch.Tensor,
    grad: torch.Tensor,
    unscoped: int,
) -> torch.Tensor:
    """dL/dh_mid through the MLP branch (norm, gate/up, SiLU·mul, down) of ``h_out = h_mid + mlp(h_mid)``, given
    grad = dL/dh_out; the residual's share is the caller's. The rows: the prompt's (their gate/up rebuilt from
    ``rec``) then the live rows, or the live rows only (``rec`` None); the first ``unscoped`` out of the cut ranks'
    scope."""
    mod = model.layers[layer]
    x2, xn2, rstd2 = _rms_norm(h_mid, mod.post_norm, model.config.rms_norm_eps)
    xa_gu = adapter.down(layer, "gate_up", x2, unscoped)
    gate_up = live_gate_up
    if rec is not None:
        gate_up = _after_live_rows(rec.num_rows, live_gate_up)
        _rebuild(adapter, layer, "gate_up", rec, xa_gu, gate_up[: rec.num_rows])
    gate, up = gate_up.chunk(2, dim=-1)
    silu = F.silu(gate)
    act = silu * up  # the down projection's input
    xa_down = adapter.down(layer, "down", act, unscoped)

    d_act = grad @ mod.down_weight
    if xa_down is not None:
        adapter.backward(layer, "down", act, xa_down, grad, d_act, unscoped)
    d_gate_up = torch.empty_like(gate_up)
    d_gate, d_up = d_gate_up.chunk(2, dim=-1)
    torch.mul(d_act, silu, out=d_up)
    torch.ops.aten.silu_backward.grad_input(d_act.mul_(up), gate, grad_input=d_gate)
    d_x2 = d_gate_up @ mod.gate_up_weight
    if xa_gu is not None:
        adapter.backward(layer, "gate_up", x2, xa_gu, d_gate_up, d_x2, unscoped)
    return _rms_norm_backward(d_x2, xn2, rstd2, mod.post_norm)


def _rms_norm(h: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``rms_norm(h)`` computed as the model does, plus what its backward reads: the normalized rows and 1/rms,
    in (at least) fp32."""
    hf = h.to(torch.promote_types(h.dtype, torch.float32))
    rstd = torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    xn = hf * rstd
    return weight * xn.to(h.dtype), xn, rstd


def _rms_norm_backward(grad: torch.Tensor, xn: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """dL/dh of ``weight * h / rms(h)``: rstd * (g - xn * mean(g * xn)) with g = grad * weight (in place on g:
    half the passes over memory of the textbook expression)."""
    g = (grad * weight).to(xn.dtype)
    mean = torch.linalg.vecdot(g, xn).unsqueeze(-1).div_(xn.shape[-1])
    return g.addcmul_(xn, mean, value=-1).mul_(rstd).to(grad.dtype)


def _stack(rec: PromptRecord, name: str, live: torch.Tensor) -> torch.Tensor:
    """[the recorded rows of ``name`` ; live rows] in the live rows' dtype (the record's rows cast as copied)."""
    return rec.rows_into(name, _after_live_rows(rec.num_rows, live))


def _after_live_rows(n: int, live: torch.Tensor) -> torch.Tensor:
    """A tensor of n + R rows whose last R are ``live``; the first n are the caller's to fill."""
    out = live.new_empty(n + live.shape[0], *live.shape[1:])
    out[n:] = live
    return out


def _rebuild(
    adapter: LoraAdapter, layer: int, name: str, rec: PromptRecord, xa: torch.Tensor | None, out: torch.Tensor
) -> None:
    """Writes the prompt rows' output of projection ``name`` into ``out``: the recorded base output plus the LoRA
    delta of the rows' down-projection (``xa``, all rows: the first n are the prompt's)."""
    rec.rows_into(name, out)
    if xa is not None:
        adapter.add_up_(layer, name, out, xa[: rec.num_rows])
