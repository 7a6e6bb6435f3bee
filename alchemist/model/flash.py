"""Attention that gives its log-sum-exp, and the backward of attention from its output and log-sum-exp.

Recording stores each prompt row's attention output and lse; replay's backward consumes them instead of running the
forward again (design note, sections 4 and 6). The backward recomputes each probability as exp(score - lse) and
uses rowsum(d_out * out), so it gives the gradients of the softmax whose lse it was handed: two calls over two key
sets, each handed the merged output and lse, give exactly the gradients of one attention over all keys
(``alchemist.training.live_attention``).

Layout as the ATen kernels: q (B, H, Lq, D); k, v (B, Hkv, Lk, D), H a multiple of Hkv (query head h reads key
head h // (H / Hkv)); lse (B, H, Lq) in fp32 (fp64 for fp64). ``causal``: query i sees keys 0 .. i (top-left;
every caller has Lq == Lk); ``mask``: an additive (Lq, Lk) mask.

On CPU (the one capability check, ``q.device.type == "cpu"``) these are ATen's CPU flash kernels, but for the
backward of short sequences (``EXPLICIT_BACKWARD_MAX_SCORES``). Elsewhere (CUDA) the same contract is computed from
explicit scores in fp32: exact, (Lq, Lk) scores per head in memory, and not the fast path;
tests/model/test_flash.py holds the two equal on CPU, ``python -m tests.cuda.check_system`` on a GPU.
ATen's CUDA kernels also give the lse, but their backward takes the forward's own padded lse and RNG state.
"""

from __future__ import annotations

import torch

_cpu_forward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_cpu_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


# Up to this many scores per head (Lq x Lk) the backward from explicit scores is the faster one on CPU: ATen's flash
# kernel has a fixed cost that short sequences (a training step's corrections and anchors) never amortize
# (docs/benchmarks.md, "Attention backward of short sequences").
EXPLICIT_BACKWARD_MAX_SCORES = 128 * 128


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """The log-sum-exp is kept at the attention kernel's accumulation precision: fp32 (fp64 for fp64)."""
    return torch.promote_types(dtype, torch.float32)


def forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    scale: float,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> out (B, H, Lq, D) in q's dtype, lse (B, H, Lq)."""
    if q.device.type == "cpu":
        out, lse = _cpu_forward(q, k, v, 0.0, causal, attn_mask=mask, scale=scale)
        return out, lse
    return explicit_forward(q, k, v, causal=causal, scale=scale, mask=mask)


def backward(
    d_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> dq (B, H, Lq, D), dk and dv (B, Hkv, Lk, D), in the inputs' dtype."""
    if q.device.type == "cpu" and q.shape[-2] * k.shape[-2] > EXPLICIT_BACKWARD_MAX_SCORES:
        dq, dk, dv = _cpu_backward(d_out, q, k, v, out, lse, 0.0, causal, scale=scale)
        return dq, dk, dv
    return explicit_backward(d_out, q, k, v, out, lse, causal=causal, scale=scale)


class Attention(torch.autograd.Function):
    """Causal attention (no mask) with autograd, by ``forward`` and ``backward``: a training forward's attention."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        out, lse = forward(q, k, v, causal=True, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, d_out: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = backward(d_out, q, k, v, out, lse, causal=True, scale=ctx.scale)
        return dq, dk, dv, None


def explicit_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    scale: float,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``forward`` from explicit scores (any device)."""
    scores = _scores(q, k, causal, scale, mask)
    lse = scores.logsumexp(-1)
    probs = scores.sub_(lse.unsqueeze(-1)).exp_()
    out = probs @ v.to(probs.dtype).unsqueeze(2)
    return out.flatten(1, 2).to(q.dtype), lse.flatten(1, 2).to(lse_dtype(q.dtype))


def explicit_backward(
    d_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``backward`` from explicit scores (any device)."""
    kv_heads = k.shape[1]
    scores = _scores(q, k, causal, scale, None)
    ct = scores.dtype
    probs = scores.sub_(_by_group(lse.to(ct).unsqueeze(-1), kv_heads)).exp_()  # (B, Hkv, G, Lq, Lk)
    d_o = _by_group(d_out.to(ct), kv_heads)
    dv = (probs.transpose(-1, -2) @ d_o).sum(2)
    d_probs = d_o @ v.to(ct).unsqueeze(2).transpose(-1, -2)
    delta = (d_o * _by_group(out.to(ct), kv_heads)).sum(-1, keepdim=True)
    d_scores = probs.mul_(d_probs.sub_(delta)).mul_(scale)
    dq = (d_scores @ k.to(ct).unsqueeze(2)).flatten(1, 2)
    dk = (d_scores.transpose(-1, -2) @ _by_group(q.to(ct), kv_heads)).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _by_group(t: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(B, H, ...) -> (B, Hkv, H / Hkv, ...): the query heads that share each key head, side by side."""
    return t.unflatten(1, (kv_heads, t.shape[1] // kv_heads))


def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float, mask: torch.Tensor | None) -> torch.Tensor:
    """(B, Hkv, H / Hkv, Lq, Lk) scaled, masked scores in fp32 (fp64 for fp64)."""
    ct = lse_dtype(q.dtype)
    scores = _by_group(q.to(ct), k.shape[1]) @ k.to(ct).unsqueeze(2).transpose(-1, -2)
    scores.mul_(scale)
    if mask is not None:
        scores.add_(mask.to(ct))
    if causal:
        lq, lk = scores.shape[-2:]
        above = torch.ones(lq, lk, dtype=torch.bool, device=q.device).triu_(1)
        scores.masked_fill_(above, float("-inf"))
    return scores
