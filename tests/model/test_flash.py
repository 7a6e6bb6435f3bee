"""The attention kernels that give and take the log-sum-exp: the explicit-scores path (what runs off CPU, e.g. on
CUDA) equals the CPU flash kernels, forward and backward, and replay on it still equals recompute."""

from __future__ import annotations

import pytest
import torch

from alchemist.model import flash
from alchemist.model.attention import bottom_right_causal_mask
from alchemist.model.loader import build_model
from tests.training.recording import record_alone
from tests.training.test_replay import flat, lora_with_nonzero_b, recompute_grads, replay_grads

# (heads, kv heads, queries, keys, causal, bottom-right mask)
SHAPES = [
    (6, 2, 37, 37, True, False),
    (4, 4, 5, 29, False, False),
    (6, 3, 11, 40, False, True),
    (2, 1, 1, 1, True, False),
]


def _inputs(heads, kv_heads, lq, lk, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v, d_out = (torch.randn(1, h, n, 16, generator=g) for h, n in
                      ((heads, lq), (kv_heads, lk), (kv_heads, lk), (heads, lq)))  # fmt: skip
    return [t.to(dtype) for t in (q, k, v, d_out)]


def _rel(a, b):
    """Relative L2 error, against at least 1 (a one-key softmax's dq is exactly 0, rounding noise in the kernel)."""
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1.0)).item()


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 2e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("shape", SHAPES)
def test_explicit_equals_cpu_flash(shape, dtype, tol):
    heads, kv_heads, lq, lk, causal, masked = shape
    q, k, v, d_out = _inputs(heads, kv_heads, lq, lk, dtype)
    mask = bottom_right_causal_mask(lq, lk, dtype, q.device) if masked else None
    kw = dict(causal=causal, scale=0.3)
    out, lse = flash.forward(q, k, v, mask=mask, **kw)
    out_x, lse_x = flash.explicit_forward(q, k, v, mask=mask, **kw)
    assert out_x.dtype == out.dtype == dtype and lse_x.dtype == lse.dtype == flash.lse_dtype(dtype)
    assert out_x.shape == out.shape and lse_x.shape == lse.shape == (1, heads, lq)
    assert _rel(out_x, out) <= tol and _rel(lse_x, lse) <= tol
    if masked:
        return  # the backward is never handed a mask (replay's attention is causal or sees every key)
    grads = flash._cpu_backward(d_out, q, k, v, out, lse, 0.0, causal, scale=kw["scale"])
    grads_x = flash.explicit_backward(d_out, q, k, v, out, lse, **kw)
    for got, want in zip(grads_x, grads, strict=True):
        assert got.dtype == want.dtype == dtype and got.shape == want.shape
        assert _rel(got, want) <= tol


@pytest.mark.parametrize("length, explicit", [(128, True), (129, False)])
def test_backward_takes_explicit_scores_up_to_the_bound_and_atens_kernel_beyond(length, explicit):
    """On CPU the backward of short sequences is the explicit one, of longer ones ATen's flash kernel: each exactly."""
    q, k, v, d_out = _inputs(6, 2, length, length, torch.float32)
    out, lse = flash.forward(q, k, v, causal=True, scale=0.3)
    assert (length * length <= flash.EXPLICIT_BACKWARD_MAX_SCORES) is explicit
    grads = flash.backward(d_out, q, k, v, out, lse, causal=True, scale=0.3)
    if explicit:
        want = flash.explicit_backward(d_out, q, k, v, out, lse, causal=True, scale=0.3)
    else:
        want = flash._cpu_backward(d_out, q, k, v, out, lse, 0.0, True, scale=0.3)
    assert all(torch.equal(got, w) for got, w in zip(grads, want, strict=True))


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 2e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("length", [37, 200])
def test_training_attention_has_the_gradients_of_atens(dtype, tol, length):
    """A training forward's causal attention (``flash.Attention``, which ``attention.sdpa`` takes where gradients
    are wanted) gives ATen's output and gradients, short sequences and long."""
    q, k, v, d_out = _inputs(6, 2, length, length, dtype)
    got, want = [], []
    for into, attend in ((got, lambda *t: flash.Attention.apply(*t, 0.3)),
                         (want, lambda *t: torch.nn.functional.scaled_dot_product_attention(
                             *t, is_causal=True, scale=0.3, enable_gqa=True))):  # fmt: skip
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = attend(*leaves)
        out.backward(d_out)
        into += [out.detach(), *(t.grad for t in leaves)]
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype == dtype and _rel(g, w) <= tol


def test_explicit_backward_is_autograd_of_softmax_attention():
    """Against the textbook: softmax attention written out, differentiated by autograd (fp64, GQA, causal)."""
    q, k, v, d_out = _inputs(6, 2, 23, 23, torch.float64, seed=1)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    k3, v3 = (t.repeat_interleave(3, dim=1) for t in (k, v))
    scores = (q @ k3.transpose(-1, -2) * 0.25).masked_fill(torch.ones(23, 23, dtype=torch.bool).triu(1), -torch.inf)
    (scores.softmax(-1) @ v3).backward(d_out)
    out, lse = flash.explicit_forward(q.detach(), k.detach(), v.detach(), causal=True, scale=0.25)
    assert _rel(lse, scores.logsumexp(-1)) <= 1e-12
    grads = flash.explicit_backward(d_out, q.detach(), k.detach(), v.detach(), out, lse, causal=True, scale=0.25)
    for got, t in zip(grads, (q, k, v), strict=True):
        assert _rel(got, t.grad) <= 1e-12


def test_replay_on_explicit_kernels_equals_recompute(tiny_dirs, monkeypatch):
    """The whole record -> replay path with the kernels a CUDA device runs (recording, live forward, walk)."""
    monkeypatch.setattr(flash, "forward", flash.explicit_forward)
    monkeypatch.setattr(flash, "backward", flash.explicit_backward)
    model = build_model(tiny_dirs["llama-gqa-untied"], torch.float32)
    adapter = lora_with_nonzero_b(model)
    g = torch.Generator().manual_seed(5)
    prompt, response = torch.randint(0, 256, (41,), generator=g), torch.randint(0, 256, (9,), generator=g)
    record = record_alone(model, adapter, prompt)
    loss_r, want = recompute_grads(model, adapter, prompt, response)
    loss_p, got = replay_grads(model, adapter, record, prompt, response)
    assert abs(loss_p - loss_r) <= 1e-5 * abs(loss_r)
    assert ((flat(got) - flat(want)).norm() / flat(want).norm()).item() <= 1e-5
