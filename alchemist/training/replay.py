"""The replay path: train on a sample whose prompt the serving prefill recorded, without recomputing the prompt.

Built as the layer walk of shared/design/activation-reuse.md, section 6:

1. The **live forward**: positions P-1 .. P+R-2 (the last prompt token and every response token but the last:
   exactly the rows whose logits carry loss) run forward through all layers, without autograd. At each layer
   they attend to [prompt K/V ; their own K/V], the prompt's rebuilt from the record (recorded base k/v outputs +
   the live LoRA delta on the recorded layer input, then RoPE). Each layer keeps what its backward will read
   (``LiveLayer``): the live rows' forward values and the keys and values of all rows.
2. The loss's gradient with respect to the live rows' final hidden states (autograd over the final norm and the
   LM head only).
3. **Walk** the layers from the top: layer l's prompt rows and live rows are differentiated together, by hand
   (``alchemist.training.layer_backward``), from the layer's record, its ``LiveLayer`` and the gradient of its
   output rows from the layer above. No base matmul runs on the prompt rows and no attention forward; each base
   weight is read once per layer for all n + R rows.

A pass without gradient (a preference objective's reference log-probabilities: ``replay_logps_slices``) is the live
forward alone, nothing kept for a walk.

Only one layer's prompt rows are worked on at a time: that is where the memory goes down. The live forward reads
each layer's record through ``record_layers`` and the walk through ``walk_layers`` (the same by default): the
trainer passes a prefetch window there (``alchemist.training.record_reader``), so that a record offloaded to host
memory or disk comes back a few layers ahead of the walk and leaves right after. The prompt's keys and values are
kept from the forward for the walk, so the adapter must not change between the two. Attention runs on the kernels
that give and take the log-sum-exp (``alchemist.model.flash``, as recording's): the CPU flash kernels on CPU,
explicit scores elsewhere (CUDA: exact, not yet fast; docs/benchmarks.md, "On a GPU").
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from alchemist.activations.record import record_widths
from alchemist.model.flash import lse_dtype
from alchemist.model.llama import Llama, rms_norm
from alchemist.model.lora import LoraAdapter, Rows
from alchemist.model.rope import Rotation
from alchemist.model.seam import COMPUTE
from alchemist.training.layer_backward import layer_backward_slices, prompt_kv
from alchemist.training.live_attention import live_attention
from alchemist.training.losses import Targets, response_loss, sequence_logp
from alchemist.training.objectives import PreferenceTerm, preference_loss
from alchemist.training.packing import LiveLayer, Packing, PromptRecord
from alchemist.training.rank_split import Scoped

RecordLayers = Callable[[int], dict[str, torch.Tensor]]


@dataclass
class ReplaySample:
    """One sample of a replay: its prompt and response ids, its prompt's record layers (``record_layers(l)``:
    layer l's record for (at least) positions 0..P-2; ``walk_layers``, default the same, gives the walk its layers
    from the top, each once), its loss's scale, and ``targets`` for an anchor (the loss is then the KL to them
    instead of the response's cross-entropy: ``alchemist.training.losses``), or ``term`` for a preference
objective's sample (``alchemist.training.objectives``)."""

    prompt_ids: torch.Tensor
    response_ids: torch.Tensor
    record_layers: RecordLayers
    walk_layers: RecordLayers | None = None
    loss_scale: float = 1.0
    targets: Targets | None = None
    term: PreferenceTerm | None = None  # a preference objective's sample (its loss_scale is unused)


def replay_backward_slices(
    model: Llama, adapter: LoraAdapter, samples: Sequence[ReplaySample], in_scope: bool = True
) -> Generator[None, None, list[float]]:
    """Replays several samples together, accumulating each one's ``loss_scale * dloss/dadapter``, in slices:
    yields after each layer of the live forward, after each sample's loss and its backward, and twice in each layer
    of the walk (``layer_backward_slices``; the points where serving may preempt training); returns the samples'
    losses.

    The samples' rows go through every layer together (``Packing``: one matmul per weight for all of them),
    attention per sample; the gradients equal the sum of the samples replayed one at a time up to rounding. The
    adapter's cut ranks act on the live rows where ``in_scope``, never on the prompt rows."""
    pack, forward, live_ids, rot = _layout(model, samples)
    walk = [(s.walk_layers or s.record_layers) if len(s.prompt_ids) > 1 else no_rows(model) for s in samples]

    # 1. The live forward, keeping each layer's values for the walk.
    lives, h = yield from live_forward(model, adapter, forward, live_ids, pack, rot, in_scope=in_scope)
    h_top = h.requires_grad_()
    # 2. Each sample's loss and its gradient at its live rows' final hidden states, a sample per slice: the LM head
    # over the live rows (and its backward) is the largest piece of work between two layers; all samples' at once
    # was one of the longest slices (docs/benchmarks.md, "Why the defaults"). The rows are disjoint: the gradients
    # are the same.
    losses = yield from _top_backward_slices(model, samples, pack, h_top)
    yield

    # 3. Walk the layers from the top down, prompt and live rows together.
    dh: torch.Tensor | None = h_top.grad  # gradient of this layer's output rows: the live rows' at the top
    for layer in reversed(range(model.config.num_layers)):
        rec = PromptRecord([layers(layer) for layers in walk], pack.prompt, model.dtype)
        assert dh is not None
        dh = yield from layer_backward_slices(model, adapter, layer, rec, lives.pop(), rot, dh, pack, in_scope)
        if layer:
            yield
    return losses


def replay_logps_slices(
    model: Llama, adapter: LoraAdapter | None, samples: Sequence[ReplaySample], in_scope: bool = True
) -> Generator[None, None, list[float]]:
    """log p(response | prompt) of each sample under ``adapter`` (None: the base model), without gradient: the live
    forward alone over the samples' records (no walk, nothing kept for one), in slices of one layer. It equals the
    recompute path's value (``recompute.sequence_logps_slices``) up to rounding when the records' layer inputs are
    that policy's: made under that adapter, or for the base model by the base model (adapter version 0)."""
    pack, forward, live_ids, rot = _layout(model, samples)
    policy = _AdapterOff() if adapter is None else adapter
    _, h = yield from live_forward(model, policy, forward, live_ids, pack, rot, keep=False,  # type: ignore[arg-type]
                                   in_scope=in_scope)  # fmt: skip
    with torch.no_grad():
        return [sequence_logp(model, pack.live_rows(h, i), s.response_ids).item() for i, s in enumerate(samples)]


def _layout(
    model: Llama, samples: Sequence[ReplaySample]
) -> tuple[Packing, list[RecordLayers], torch.Tensor, Rotation]:
    """The samples' rows laid out for a replay: their ``Packing``, the live forward's record of each, the live rows'
    token ids and the rotation of all rows."""
    pack = Packing([len(s.prompt_ids) - 1 for s in samples], [len(s.response_ids) for s in samples])
    # a one-token prompt: its live rows are the whole sequence, no record is read
    forward = [s.record_layers if len(s.prompt_ids) > 1 else no_rows(model) for s in samples]
    live_ids = torch.cat([torch.cat([s.prompt_ids[-1:], s.response_ids[:-1]]) for s in samples])
    return pack, forward, live_ids, model.rope(pack.positions(live_ids.device), model.dtype)


class _AdapterOff:
    """The base model, as the live forward reads an adapter (``prompt_kv``, ``Llama.project``): nothing targeted,
    no delta on any projection."""

    cut = 0

    def down(self, layer: int, name: str, x: torch.Tensor, unscoped: Rows = None) -> None:
        return None

    def delta(self, layer: int, name: str, x: torch.Tensor, unscoped: Rows = None) -> None:
        return None


def _top_backward_slices(
    model: Llama, samples: Sequence[ReplaySample], pack: Packing, h_top: torch.Tensor
) -> Generator[None, None, list[float]]:
    """The losses' gradients at the live rows' final hidden states (into ``h_top.grad``), a sample per slice;
    returns each sample's loss. A preference sample's gradient depends on its and its pair's values: their sequence
    log-probabilities are taken first without a graph, the objective's derivative with respect to each is its
    scale (``objectives.preference_loss``), then its head runs again with the graph (memory over time: a graph of
    log-probabilities over the vocabulary per sample would be kept otherwise)."""
    losses: list[float] = [0.0] * len(samples)
    values: dict[int, torch.Tensor] = {}
    for i, s in enumerate(samples):
        yield
        rows = pack.live_rows(h_top, i)
        if s.term is not None:
            with torch.no_grad():
                values[i] = sequence_logp(model, rows, s.response_ids)
            continue
        loss = response_loss(model, rows, s.response_ids, s.targets)
        (loss * s.loss_scale).backward()
        losses[i] = loss.item()
    if values:
        v = torch.stack(list(values.values())).requires_grad_()
        objective, own = preference_loss(v, [samples[i].term for i in values])  # type: ignore[misc]
        (scales,) = torch.autograd.grad(objective, v)
        for (i, loss), scale in zip(zip(values, own, strict=True), scales.tolist(), strict=True):
            yield
            (sequence_logp(model, pack.live_rows(h_top, i), samples[i].response_ids) * scale).backward()
            losses[i] = loss
    return losses


@torch.no_grad()  # (on a generator: grad mode is off only while its body runs, not while it is paused)
def live_forward(
    model: Llama,
    adapter: LoraAdapter,
    record_layers: Sequence[RecordLayers],
    live_ids: torch.Tensor,
    pack: Packing,
    rot: Rotation,
    keep: bool = True,
    in_scope: bool = True,
) -> Generator[None, None, tuple[list[LiveLayer], torch.Tensor]]:
    """The live rows of each sample (its positions n .. n+R-1) through every layer, attending to its prompt's n
    recorded rows, in slices of one layer; returns each layer's ``LiveLayer`` (none unless ``keep``: a pass without
    a walk) and the final hidden states (R, d) of all live rows."""
    c = model.config
    n = pack.num_prompt
    rot_prompt, rot_live = rot.rows(0, n), rot.rows(n)
    lives: list[LiveLayer] = []
    h = F.embedding(live_ids, model.embed)
    live = adapter if in_scope or not adapter.cut else Scoped(adapter, len(live_ids))  # the live rows' adapter
    for layer in range(c.num_layers):
        rec = PromptRecord([layers(layer) for layers in record_layers], pack.prompt, model.dtype)
        k_prompt, v_prompt = prompt_kv(model, adapter, layer, rec, rot_prompt)
        q, k, v = model.attention_inputs(layer, h, rot_live, COMPUTE, live)
        # each sample's keys and values: [its prompt's ; its live rows'] (n + R, Hkv, Dh)
        ks = [torch.cat([pack.prompt_rows(k_prompt, i), pack.live_rows(k, i)]) for i in range(len(pack))]
        vs = [torch.cat([pack.prompt_rows(v_prompt, i), pack.live_rows(v, i)]) for i in range(len(pack))]
        outs = [live_attention(pack.live_rows(q, i), ks[i], vs[i], pack.prompt[i]) for i in range(len(pack))]
        out, lse = outs[0] if len(outs) == 1 else (torch.cat([o for o, _ in outs]), torch.cat([s for _, s in outs]))
        h_mid = model.attention_output(layer, h, out, COMPUTE, live)
        # model.mlp, spelled out to keep gate/up (with its delta) for the walk
        gate_up = model.project(layer, "gate_up", rms_norm(h_mid, model.layers[layer].post_norm, c.rms_norm_eps),
                                COMPUTE, live)  # fmt: skip
        gate, up = gate_up.chunk(2, dim=-1)
        if keep:
            lives.append(LiveLayer(h, q, ks, vs, out.flatten(-2), lse, h_mid, gate_up))
        h = h_mid + model.project(layer, "down", F.silu(gate) * up, COMPUTE, live)
        if layer < c.num_layers - 1:
            yield
    return lives, h


def no_rows(model: Llama) -> RecordLayers:
    """A record of no rows (each tensor empty, of the recorded width)."""
    lse = lse_dtype(model.dtype)
    empty = {name: model.embed.new_empty(0, width, dtype=lse if name == "lse" else None)
             for name, width in record_widths(model.config).items()}  # fmt: skip
    return lambda layer: empty
