"""The replay path: train on a sample whose prompt the serving prefill recorded, without recomputing the prompt.

Built as the layer walk of shared/design/activation-reuse.md, section 6:

1. The **live stream** is positions P-1 .. P+R-2 (the last prompt token and every response token but the last:
   exactly the rows whose logits carry loss). It runs forward through all layers; at each layer it attends to
   [prompt K/V ; its own K/V], where the prompt's K/V (positions 0..P-2) are **leaf tensors** built from the
   record (recorded base q/k/v outputs + the live LoRA delta on the recorded layer input, then RoPE).
2. Backward of the loss through the live graph gives the LoRA gradients of the live rows and dK, dV of every
   layer's prompt leaves.
3. **Walk** the layers from the top: layer l's prompt rows are differentiated by hand
   (``alchemist.training.prompt_backward``) from the layer's record, the gradient dh of its output rows (from the
   layer above; none at the top) and dK_l, dV_l of its leaves (the live rows' attention to the prompt). No base
   matmul and no attention forward runs; only the cheap ops whose values the backward needs are recomputed.

Only one layer's prompt rows are worked on at a time: that is where the memory goes down. Phase 1 reads each
layer's record through ``record_layers`` and the walk through ``walk_layers`` (the same by default): the trainer
passes a prefetch window there (``alchemist.training.record_reader``), so that a record offloaded to host memory
or disk comes back a few layers ahead of the walk and leaves right after. The leaves' values are reused by the
walk, so the adapter must not change between the two phases.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import TypeVar

import torch
import torch.nn.functional as F

from alchemist.model.attention import bottom_right_causal_mask
from alchemist.model.llama import Llama
from alchemist.model.lora import LoraAdapter
from alchemist.model.seam import COMPUTE
from alchemist.training.losses import Targets, response_loss
from alchemist.training.prompt_backward import PromptRecord, prompt_kv, prompt_layer_backward

T = TypeVar("T")
RecordLayers = Callable[[int], dict[str, torch.Tensor]]


_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


class LiveAttention(torch.autograd.Function):
    """The live rows' attention, split over two key sets and merged by log-sum-exp: the prompt's keys (all
    visible: no mask) and the live rows' own keys (square and causal, so the kernel skips the blocks above the
    diagonal). One masked call over the concatenation would compute every block and copy K/V into it.

    The backward runs the flash backward once per key set with the *merged* output and lse: it recomputes each
    probability as exp(score - lse) and uses rowsum(dout * out), both of which are those of the whole softmax,
    so the two calls give exactly the gradients of one attention over all keys. Shapes (1, heads, rows, Dh).
    """

    @staticmethod
    def forward(ctx, q, k_prompt, v_prompt, k_live, v_live, scale: float):  # type: ignore[override]
        out_p, lse_p = _flash(q, k_prompt, v_prompt, 0.0, False, scale=scale)
        out_l, lse_l = _flash(q, k_live, v_live, 0.0, True, scale=scale)
        lse = torch.logaddexp(lse_p, lse_l)
        out = (lse_p - lse).exp().unsqueeze(-1).to(q.dtype) * out_p + (lse_l - lse).exp().unsqueeze(-1).to(
            q.dtype
        ) * out_l
        ctx.save_for_backward(q, k_prompt, v_prompt, k_live, v_live, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        q, k_prompt, v_prompt, k_live, v_live, out, lse = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        dq_p, dk_p, dv_p = _flash_backward(grad_out, q, k_prompt, v_prompt, out, lse, 0.0, False, scale=ctx.scale)
        dq_l, dk_l, dv_l = _flash_backward(grad_out, q, k_live, v_live, out, lse, 0.0, True, scale=ctx.scale)
        return dq_p + dq_l, dk_p, dv_p, dk_l, dv_l, None


def live_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_prompt: torch.Tensor, v_prompt: torch.Tensor
) -> torch.Tensor:
    """q, k, v (R, heads, Dh) of the live rows; k_prompt, v_prompt (n, Hkv, Dh) -> (R, H, Dh)."""
    to4d = lambda t: t.transpose(0, 1).unsqueeze(0)  # noqa: E731
    scale = q.shape[-1] ** -0.5
    if q.device.type == "cpu":
        out = LiveAttention.apply(to4d(q), to4d(k_prompt), to4d(v_prompt), to4d(k), to4d(v), scale)
    else:  # CUDA: one masked SDPA over [prompt ; live] keys
        num_q, num_k = q.shape[0], k_prompt.shape[0] + k.shape[0]
        mask = bottom_right_causal_mask(num_q, num_k, q.dtype, q.device)
        k, v = torch.cat([k_prompt, k]), torch.cat([v_prompt, v])
        out = F.scaled_dot_product_attention(to4d(q), to4d(k), to4d(v), attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


def replay_backward(
    model: Llama,
    adapter: LoraAdapter,
    record_layers: RecordLayers,
    prompt_ids: torch.Tensor,
    response_ids: torch.Tensor,
    loss_scale: float = 1.0,
    targets: Targets | None = None,
) -> float:
    """Accumulates ``loss_scale * dloss/dadapter`` into the adapter's .grad; returns the loss.

    ``record_layers(l)`` gives layer l's record for (at least) positions 0..P-2 of this prompt.
    """
    return run_to_end(
        replay_backward_slices(model, adapter, record_layers, prompt_ids, response_ids, loss_scale, targets=targets)
    )


def run_to_end(slices: Generator[None, None, T]) -> T:
    """Runs a sliced computation without pausing; returns its result."""
    while True:
        try:
            next(slices)
        except StopIteration as done:
            return done.value


def replay_backward_slices(
    model: Llama,
    adapter: LoraAdapter,
    record_layers: RecordLayers,
    prompt_ids: torch.Tensor,
    response_ids: torch.Tensor,
    loss_scale: float = 1.0,
    walk_layers: RecordLayers | None = None,
    targets: Targets | None = None,
) -> Generator[None, None, float]:
    """``replay_backward`` in slices: yields after the live stream's forward and backward and after each layer of
    the walk (the points where serving may preempt training); returns the loss. ``walk_layers`` (default
    ``record_layers``) gives the walk its layers, from the top, each once. ``targets``: the loss is the KL to them
    (an anchor, ``alchemist.training.losses``) instead of the response's cross-entropy."""
    walk_layers = walk_layers or record_layers
    num_prompt, dtype, device = len(prompt_ids), model.dtype, prompt_ids.device
    n = num_prompt - 1  # prompt rows replayed; row P-1 runs live
    live_ids = torch.cat([prompt_ids[-1:], response_ids[:-1]])
    rot_live = model.rope(torch.arange(n, n + len(live_ids), device=device), dtype)
    rot_prompt = model.rope(torch.arange(n, device=device), dtype)

    # 1. Live stream forward, with each layer's prompt K/V as leaves.
    leaves: list[tuple[torch.Tensor, torch.Tensor]] = []
    h = F.embedding(live_ids, model.embed)
    for layer in range(model.config.num_layers):
        if n:
            rec = PromptRecord(record_layers(layer), n, dtype)
            k_p, v_p = prompt_kv(model, adapter, layer, rec, rot_prompt)
            leaves.append((k_p.requires_grad_(), v_p.requires_grad_()))
        q, k, v = model.attention_inputs(layer, h, rot_live, COMPUTE, adapter)
        if n:
            attn = live_attention(q, k, v, *leaves[-1])
        else:  # a one-token prompt: the live rows are the whole sequence
            attn = F.scaled_dot_product_attention(
                *(t.transpose(0, 1) for t in (q, k, v)), is_causal=True, enable_gqa=q.shape[1] != k.shape[1]
            ).transpose(0, 1)
        h = model.mlp(layer, model.attention_output(layer, h, attn, COMPUTE, adapter), COMPUTE, adapter)
    loss = response_loss(model, h, response_ids, targets)
    yield
    (loss * loss_scale).backward()
    if not n:
        return loss.item()
    yield

    # 2. Walk the prompt rows from the top layer down, one layer at a time.
    dh: torch.Tensor | None = None  # gradient of this layer's output rows (none above the top layer)
    for layer in reversed(range(model.config.num_layers)):
        k_leaf, v_leaf = leaves.pop()
        rec = PromptRecord(walk_layers(layer), n, dtype)
        dh = prompt_layer_backward(
            model, adapter, layer, rec, rot_prompt, k_leaf.detach(), v_leaf.detach(), k_leaf.grad, v_leaf.grad, dh
        )
        if layer:
            yield
    return loss.item()
