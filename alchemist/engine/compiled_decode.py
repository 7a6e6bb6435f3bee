"""The engine's steps compiled with ``torch.compile``: each layer of a step that records nothing as one inductor graph.

    compiled = CompiledDecode.create(model, cache, config)       # None where it does not apply
    hidden = compiled.forward(input_ids, positions, slots, ops)  # a decode step: (B,) each -> (B, d)
    hidden = compiled.forward_step(input_ids, positions, meta, ops)  # a step with prompt chunks: (T,) -> (T, d)

A step runs 30 layers of small ops: besides the linears and attention, about ten elementwise ops per layer (RMSNorm
in fp32 and back, RoPE, SiLU-mul, residual adds), each a kernel launch and a memory pass. Here one function holds a
layer's math with everything passed in as tensors (hidden rows, RoPE cos/sin, the layer's weights and cache), so
inductor fuses the glue into a few C++ loops between the opaque calls: the linears (``alchemist::packed_linear``,
``csrc/packed_linear.cpp``, over oneDNN-packed bf16 weights, or ``F.linear`` in fp32) and attention. A decode step's
attention is our decode kernel (``alchemist::decode_attention``, which writes the rows' keys and values into the
cache in place); a step with prompt chunks (beside decodes, under load most steps are) calls the eager attention
(``attention.attend``) through ``alchemist::step_attention``, a Python op the compiler keeps opaque, which reads the
step's segments from the step in progress. Compiling only decode steps left the steps beside them eager, about 1.2x
slower, and the step cost model learned the difference as prefill cost (docs/benchmarks.md, "Serving against vLLM").

Note: [One graph per layer, not per step] Every layer has the same shapes, so the layer function compiles once and
serves all of them, in seconds; a whole step traced as one graph (30 layers unrolled) took about ten times longer
per batch size to compile and gained little more at batch 32 (docs/benchmarks.md, "Compiled decode step"). The batch
dimension is dynamic after the first two sizes (dynamo's automatic dynamic shapes): warm-up compiles batch 1 and
batch 2, and every other batch size reuses the second graph, so no decode batch is padded to a bucket; a step with
prompt chunks pads its rows to a multiple of 16, as eager linears do, and warm-up compiles 16 and 32 rows. Weights
are graph inputs, not constants, so a newly merged adapter serves without recompiling. inductor's cache lives in
``$ALCHEMIST_CACHE/inductor``: a second start loads its graphs and C++ kernels instead of building them, whatever
its limits (the cache's slots and length are dynamic sizes: docs/benchmarks.md, "Compiled decode step").

It applies to forwards that add no separate adapter delta and record nothing (every step but those right after a swap
whose merge is not complete, and those with a recorded prompt chunk), on a CPU where our decode kernel runs:
``EngineConfig.compile_decode``; and to decode steps of several adapters whose deltas are all grouped
(``alchemist.engine.adapter_groups``), through a layer of its own (``grouped_decode_layer``), compiled at the first
such step with every size dynamic.
fp32 greedy tokens equal the eager path's (tests/engine/test_compiled_decode.py); in bf16 inductor keeps some
intermediates in fp32 that eager rounds, so the two agree to bf16 rounding, like any two bf16 kernels (its
batch-1 graph and dynamic graph too: a bf16 greedy answer depends on the batches it decodes in, docs/benchmarks.md
"Greedy answers and the batches they decode in").
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from alchemist.engine.adapter_groups import GroupedRows, LayerDeltas, grouped_delta
from alchemist.engine.packed_ops import ROW_MULTIPLE
from alchemist.model import cpu_kernels
from alchemist.model.attention import AttentionMetadata, KVCache, Segment, attend
from alchemist.model.gguf import default_cache_dir
from alchemist.model.llama import Llama, rms_norm
from alchemist.model.rope import Rotation, apply_rotary
from alchemist.model.seam import LINEAR_NAMES

log = logging.getLogger(__name__)


class LayerWeights(NamedTuple):
    """One layer's weights as the compiled layer takes them; the projections in the ops object's layout (packed for
    oneDNN, merged with the served adapter)."""

    input_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


@dataclass(frozen=True)
class LayerShape:
    """The model's sizes, constants of the compiled graph."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    eps: float
    packed: bool  # projections are oneDNN-packed (opaque op) rather than plain weights (F.linear)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: int, s: LayerShape) -> torch.Tensor:
    # The packed linear as our opaque op (csrc/packed_linear.cpp): inductor lowers oneDNN's only for frozen weights.
    return torch.ops.alchemist.packed_linear(x, weight, bias, out) if s.packed else F.linear(x, weight, bias)


def _project(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: int, s: LayerShape,
    deltas: LayerDeltas | None, name: str,
) -> torch.Tensor:  # fmt: skip
    """The linear, plus the step's grouped adapter deltas where it has them (``Llama.project``)."""
    y = _linear(x, weight, bias, out, s)
    if deltas is not None and (ab := getattr(deltas, name)) is not None:
        y = y + grouped_delta(x, *ab, deltas.gather, deltas.back)
    return y


def layer_math(
    h: torch.Tensor, rot: Rotation, w: LayerWeights, s: LayerShape, attention, deltas: LayerDeltas | None = None
) -> torch.Tensor:
    """``Llama.layer_forward`` over tensors only, h (T, d) -> (T, d), with ``attention(q, k, v)`` (RoPE applied;
    it writes the keys and values into the cache) as the one opaque call besides the linears; ``deltas``: the
    grouped deltas of the step's adapters (``alchemist.engine.adapter_groups``), or none."""
    x = rms_norm(h, w.input_norm, s.eps)
    qkv = _project(x, w.qkv, w.qkv_bias, s.q_size + 2 * s.kv_size, s, deltas, "qkv")
    q, k, v = qkv.split([s.q_size, s.kv_size, s.kv_size], dim=-1)
    q = apply_rotary(q.view(-1, s.num_heads, s.head_dim), rot)
    k = apply_rotary(k.view(-1, s.num_kv_heads, s.head_dim), rot)
    v = v.view(-1, s.num_kv_heads, s.head_dim)
    h = h + _project(attention(q, k, v).flatten(-2), w.o, None, s.hidden_size, s, deltas, "o")
    x = rms_norm(h, w.post_norm, s.eps)
    gate, up = _project(x, w.gate_up, None, 2 * s.intermediate_size, s, deltas, "gate_up").chunk(2, dim=-1)
    return h + _project(F.silu(gate) * up, w.down, None, s.hidden_size, s, deltas, "down")


def decode_layer(
    h: torch.Tensor,
    rot: Rotation,
    slots: torch.Tensor,
    positions: torch.Tensor,
    w: LayerWeights,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    s: LayerShape,
    deltas: LayerDeltas | None = None,
) -> torch.Tensor:
    """A layer for B decode rows, h (B, d) -> (B, d): attention by our decode kernel."""

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.ops.alchemist.decode_attention(q, k, v, k_cache, v_cache, slots, positions, s.head_dim**-0.5)

    return layer_math(h, rot, w, s, attention, deltas)


def grouped_decode_layer(
    h: torch.Tensor,
    rot: Rotation,
    slots: torch.Tensor,
    positions: torch.Tensor,
    w: LayerWeights,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    s: LayerShape,
    deltas: LayerDeltas,
) -> torch.Tensor:
    """``decode_layer`` with the grouped deltas of the step's adapters: a function of its own, so that its graphs
    (compiled at the first such step) are kept apart from the warm ones of ``decode_layer``."""
    return decode_layer(h, rot, slots, positions, w, k_cache, v_cache, s, deltas)


def step_layer(
    h: torch.Tensor,
    rot: Rotation,
    layer: torch.Tensor,
    w: LayerWeights,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    s: LayerShape,
) -> torch.Tensor:
    """A layer for the rows of a step with prompt chunks (beside decodes or not), h (T, d) -> (T, d): attention by
    ``step_attention`` over the step's segments."""

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.ops.alchemist.step_attention(q, k, v, k_cache, v_cache, layer)

    return layer_math(h, rot, w, s, attention)


_step = threading.local()  # the step in progress (CompiledDecode.forward_step): its AttentionMetadata, as .meta


@torch.library.custom_op("alchemist::step_attention", mutates_args=("k_cache", "v_cache"))
def step_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    layer: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """``attention.attend`` of layer ``layer`` (a 0-d tensor: an int would make a graph per layer) over the first
    ``meta.num_tokens`` rows, those of the step in progress (``_step.meta``), writing their keys and values into
    ``k_cache`` / ``v_cache``; the rows after them, padding, get zeros. Opaque to the compiler, as eager attention
    is: its segments are Python data."""
    meta = _step.meta
    n = meta.num_tokens
    out = q.new_zeros(q.shape)
    out[:n] = attend(int(layer), q[:n], k[:n], v[:n], meta).out
    return out


@step_attention.register_fake
def _(q, k, v, k_cache, v_cache, layer):
    return torch.empty_like(q)


@functools.cache
def _compiled_layer(
    fn: Callable[..., torch.Tensor], shape: LayerShape, dtype: torch.dtype
) -> Callable[..., torch.Tensor]:
    """``fn`` (``decode_layer`` or ``step_layer``) compiled for one model's shape and dtype, shared by its engines.
    Each gets a code object of its own: dynamo keeps its graphs per code object, under a limit of 8, and a process
    that builds engines of several models (tests, a library user) would reach it; one model needs two of each (one
    row, and the dynamic row count)."""
    code = fn.__code__.replace()  # a new, equal code object
    return torch.compile(types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__), fullgraph=True)


def _mark_dynamic(h: torch.Tensor, rot: Rotation, slots: torch.Tensor, positions: torch.Tensor,
                  deltas: LayerDeltas) -> None:  # fmt: skip
    """The first grouped step's sizes as dynamic from the start: the rows, the grouped places and the slots change
    from step to step, and a recompile each time one first changes would stall serving for seconds."""
    for t in (h, *rot, slots, positions, deltas.back, deltas.gather):
        torch._dynamo.maybe_mark_dynamic(t, 0)
    for ab in deltas[2:]:
        if ab is not None:
            for t in (ab[0], *ab[1]):  # A, and each part's B
                torch._dynamo.maybe_mark_dynamic(t, 0)


def compiled_decode_supported(cache: KVCache) -> bool:
    """Where the compiled step can run: a CPU cache in bf16 or fp32 and our decode kernel built."""
    k = cache.k[0]
    cpu = k.device.type == "cpu" and k.dtype in (torch.bfloat16, torch.float32)
    return cpu and cpu_kernels.decode_attention_op() is not None and cpu_kernels.packed_linear_op() is not None


def compiled_decode_applies(cache: KVCache, setting: bool | None) -> bool:
    """``EngineConfig.compile_decode``: None (the default) compiles where it was measured faster, a bf16 cache (on a
    Zen 5, and on an AMX Xeon, where eager decode attention is ATen's: docs/benchmarks.md, "Compiled decode step");
    True wherever it can run (fp32 included: the exactness tests); False never (``--enforce-eager``)."""
    if setting is False or not compiled_decode_supported(cache):
        return False
    return setting is True or cache.k[0].dtype == torch.bfloat16


class CompiledDecode:
    def __init__(self, model: Llama, cache: KVCache, packed: bool) -> None:
        c = model.config
        self.model, self.cache = model, cache
        self.shape = LayerShape(
            c.num_heads, c.num_kv_heads, c.head_dim, c.hidden_size, c.intermediate_size, c.rms_norm_eps, packed
        )
        self._layer = _compiled_layer(decode_layer, self.shape, model.dtype)
        self._step_layer = _compiled_layer(step_layer, self.shape, model.dtype)
        self._grouped_layer = _compiled_layer(grouped_decode_layer, self.shape, model.dtype)
        self._layer_ids = [torch.tensor(i) for i in range(len(model.layers))]  # step_attention's layer argument
        for k, v in zip(cache.k, cache.v, strict=True):
            # The cache's slots and length as sizes of any value: only our opaque attention ops read the cache, so
            # the graphs (and inductor's cached kernels) are the same for every --max-num-seqs and --max-model-len,
            # and a server started with other limits loads them instead of compiling anew.
            for t in (k, v):
                torch._dynamo.maybe_mark_dynamic(t, 0)
                torch._dynamo.maybe_mark_dynamic(t, 2)
        self._weights_of: tuple[object, list[LayerWeights]] | None = None  # (ops object, its weights)
        self.num_steps = 0  # decode steps run compiled (tests, profiles)
        self.num_prompt_steps = 0  # steps with prompt chunks run compiled
        self.num_grouped_steps = 0  # decode steps run compiled with several adapters' grouped deltas
        self.warm_up_s = 0.0  # how long the warm-up (the compile) took

    @classmethod
    def create(cls, model: Llama, cache: KVCache, setting: bool | None, packed: bool) -> CompiledDecode | None:
        if not compiled_decode_applies(cache, setting):
            return None
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(default_cache_dir() / "inductor"))
        return cls(model, cache, packed)

    @classmethod
    def create_warm(
        cls, model: Llama, cache: KVCache, setting: bool | None, packed: bool, ops
    ) -> CompiledDecode | None:
        """``create`` and ``warm_up``; where the compile fails (no C++ compiler for inductor, ...), a warning and
        None, so that the engine serves eager, unless compiling was asked for (``setting`` True)."""
        decode = cls.create(model, cache, setting, packed)
        if decode is None:
            return None
        try:
            decode.warm_up(ops)
        except Exception as e:
            if setting is True:
                raise
            log.warning("the decode step could not be compiled (%s: %s); serving eager", type(e).__name__, e)
            return None
        return decode

    def weights(self, ops) -> list[LayerWeights]:
        """Each layer's weights as ``ops`` projects with them (``Ops.linear_weight``), built once per ops object."""
        if self._weights_of is None or self._weights_of[0] is not ops:
            self._weights_of = (ops, [self._layer_weights(ops, i) for i in range(len(self.model.layers))])
        return self._weights_of[1]

    def _layer_weights(self, ops, i: int) -> LayerWeights:
        layer = self.model.layers[i]
        proj = {name: ops.linear_weight(i, name, getattr(layer, f"{name}_weight")) for name in LINEAR_NAMES}
        weights = (layer.input_norm, proj["qkv"], layer.qkv_bias, proj["o"], layer.post_norm, proj["gate_up"])
        # Plain tensors all: the graph guards on each input's type, and a merged weight is no Parameter.
        return LayerWeights(*(None if w is None else w.detach() for w in (*weights, proj["down"])))

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, max_position: int, ops,
        groups: GroupedRows | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """B decode rows (token, position, slot each, (B,) int64) through every layer -> final hidden (B, d); with
        the grouped deltas of ``groups`` (``GroupedRows.compilable``) if given."""
        model = self.model
        h = F.embedding(input_ids, model.embed)
        rot = model.rope(positions, h.dtype, max_position)
        for i, w in enumerate(self.weights(ops)):
            k, v = self.cache.k[i], self.cache.v[i]
            if groups is None:
                h = self._layer(h, rot, slots, positions, w, k, v, self.shape)
            else:
                deltas = groups.layer_deltas(i)
                if not self.num_grouped_steps:
                    _mark_dynamic(h, rot, slots, positions, deltas)
                h = self._grouped_layer(h, rot, slots, positions, w, k, v, self.shape, deltas)
        self.num_steps += 1
        self.num_grouped_steps += groups is not None
        return h

    def forward_step(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, ops
    ) -> torch.Tensor:
        """The T rows of a step with prompt chunks (``meta``'s segments; decodes too, or not) through every layer
        -> final hidden (T, d). The rows are padded to a multiple of ``ROW_MULTIPLE`` for the linears, as eager's
        are (oneDNN keeps a primitive per row count: packed_ops.py), and cut again."""
        model, t = self.model, input_ids.shape[0]
        pad = -t % ROW_MULTIPLE
        if pad:
            input_ids, positions = F.pad(input_ids, (0, pad)), F.pad(positions, (0, pad))
        h = F.embedding(input_ids, model.embed)
        rot = model.rope(positions, h.dtype, meta.max_position)
        _step.meta = meta
        try:
            for i, w in enumerate(self.weights(ops)):
                h = self._step_layer(h, rot, self._layer_ids[i], w, self.cache.k[i], self.cache.v[i], self.shape)
        finally:
            _step.meta = None
        self.num_prompt_steps += 1
        return h[:t]

    @torch.inference_mode()
    def warm_up(self, ops) -> None:
        """Compiles before serving: decode batch 1, then batch 2, whose recompile makes the batch dimension dynamic
        (every later size reuses it); a prompt step of 16 rows, then one of 32 (likewise). Writes positions 0 .. 31
        of slot 0 and position 0 of slot 1, which nothing holds yet."""
        start = time.perf_counter()
        for batch in (1, 2):
            zeros = torch.zeros(batch, dtype=torch.long, device=self.model.device)
            slots = torch.arange(batch, device=zeros.device) % self.cache.num_slots
            self.forward(zeros, zeros, slots, 0, ops)
        for rows in (1, 2):  # prompt steps of 16 and 32 padded rows (the second makes the row count dynamic)
            length = 16 * rows
            ids = torch.zeros(length, dtype=torch.long, device=self.model.device)
            meta = AttentionMetadata([Segment(slot=0, start=0, length=length)], cache=self.cache)
            self.forward_step(ids, torch.arange(length, device=ids.device), meta, ops)
        self.num_steps = self.num_prompt_steps = 0
        self.warm_up_s = time.perf_counter() - start
