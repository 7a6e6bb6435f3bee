"""The live rows' attention in replay, forward and backward, on the kernels that give and take the lse
(``alchemist.model.flash``).

The live rows (R queries) attend to two key sets: the prompt's n keys, all visible (no mask), and their own R keys,
square and causal (the kernel skips the blocks above the diagonal). One masked call over the concatenation would
compute every block. The forward merges the two calls by log-sum-exp. The backward runs the flash backward once per
key set with the *merged* output and lse: it recomputes each probability as exp(score - lse) and uses
rowsum(dout * out), both those of the whole softmax, so the two calls give exactly the gradients of one attention
over all keys.

Tensors are rows first, (rows, heads, Dh); the kernels take and give (1, heads, rows, Dh) views of that memory
(``heads_first`` / ``rows_first``: no copies).
"""

from __future__ import annotations

import torch

from alchemist.model import flash


def heads_first(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(0, 1).unsqueeze(0)  # (rows, heads, Dh) -> (1, heads, rows, Dh)


def rows_first(t: torch.Tensor) -> torch.Tensor:
    return t[0].transpose(0, 1)  # (1, heads, rows, Dh) -> (rows, heads, Dh)


def live_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q (R, H, Dh); k, v (n + R, Hkv, Dh): the prompt's n rows, then the live rows' -> out (R, H, Dh), lse (R, H)."""
    q4, scale = heads_first(q), q.shape[-1] ** -0.5
    out, lse = flash.forward(q4, heads_first(k[n:]), heads_first(v[n:]), causal=True, scale=scale)
    if n:
        out_p, lse_p = flash.forward(q4, heads_first(k[:n]), heads_first(v[:n]), causal=False, scale=scale)
        merged = torch.logaddexp(lse_p, lse)
        weight = lambda part_lse: (part_lse - merged).exp().unsqueeze(-1).to(q.dtype)  # noqa: E731
        out, lse = weight(lse_p) * out_p + weight(lse) * out, merged
    return rows_first(out), lse[0].t()


def live_attention_backward(
    d_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    n: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward of ``live_attention``: d_out, q, out (R, H, Dh); k, v (n + R, Hkv, Dh); lse (R, H) ->
    dq (R, H, Dh), dk and dv (n + R, Hkv, Dh)."""
    args = heads_first(d_out), heads_first(q)
    rest = heads_first(out), lse.t().unsqueeze(0)
    scale = q.shape[-1] ** -0.5
    dq, dk_l, dv_l = flash.backward(*args, heads_first(k[n:]), heads_first(v[n:]), *rest, causal=True, scale=scale)
    if not n:
        return rows_first(dq), rows_first(dk_l), rows_first(dv_l)
    dq_p, dk_p, dv_p = flash.backward(*args, heads_first(k[:n]), heads_first(v[:n]), *rest, causal=False, scale=scale)
    dk, dv = torch.cat([dk_p, dk_l], dim=2), torch.cat([dv_p, dv_l], dim=2)
    return rows_first(dq.add_(dq_p)), rows_first(dk), rows_first(dv)
