"""Profile (not a benchmark): the compiled decode layer traced once and loaded by later processes
(``torch.compile(...).aot_compile`` and ``torch.compiler.load_compiled_function``, torch 2.9+), against tracing it
at every start as ``alchemist.engine.compiled_decode`` does now.

    OMP_NUM_THREADS=1 python docs/profiles/aot_compile_layer.py save /tmp/decode_layer.bin
    OMP_NUM_THREADS=1 python docs/profiles/aot_compile_layer.py load /tmp/decode_layer.bin

SmolLM2 in bf16 with the packed linears, a cache of 4 slots of 256 positions, layer 0's weights. ``save``: the
layer traced and compiled ahead (every size dynamic; batch 2 as the example), its time, the artifact written, and
one call's output beside it; then the decode step of today's compiled layer (warmed at batch 1 and 2) and of the
artifact at batch 8, each the median of 200 calls. ``load`` (a new process): the artifact's load time, the same
output for the same input, a call at batch 5, and the load again (what each further graph would cost).
Run under ``/usr/bin/time``, ``load`` against the same process stopped before its load gives the whole cost of
the first load, its compile workers' CPU included.

What it takes (torch 2.13): a guard filter that drops the packed weights' tensor guards (an mkldnn tensor cannot be
pickled) besides what cannot be serialized; the trace under ``inference_mode`` as serving runs; no dynamo marks on
the inputs (the artifact guards against marks it was not compiled with: the engine marks its cache's dims).
"""

import statistics
import sys
import time
import types

import torch

from alchemist.config import EngineConfig
from alchemist.engine import compiled_decode
from alchemist.engine.runner import ModelRunner
from alchemist.model.loader import build_model, hf_dir_for

PACKED = ("w.qkv", "w.o", "w.gate_up", "w.down")
mode, path = sys.argv[1], sys.argv[2]
torch.set_num_threads(1)
model = build_model(hf_dir_for(None), torch.bfloat16)
runner = ModelRunner(model, EngineConfig(max_num_seqs=4, max_model_len=256, compile_decode=False))
torch.inference_mode().__enter__()
decode = compiled_decode.CompiledDecode(model, runner.cache, runner._packed)  # marks the cache's dims
weights = decode.weights(runner.ops)[0]
k_cache, v_cache = runner.cache.k[0], runner.cache.v[0]


def inputs(batch: int) -> tuple:
    ids, positions = torch.zeros(batch, dtype=torch.long), torch.arange(batch)
    h = torch.nn.functional.embedding(ids, model.embed)
    return h, model.rope(positions, h.dtype, batch), torch.arange(batch) % 4, positions


def unmarked(t: torch.Tensor) -> torch.Tensor:
    for name in ("_dynamo_dynamic_indices", "_has_dynamo_dim_marking"):
        if hasattr(t, name):
            delattr(t, name)
    return t


def guard_filter(entries) -> list[bool]:
    from torch._dynamo.guards import CheckFunctionManager

    unsupported = CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES
    return [not (e.is_global or e.guard_type in unsupported or (e.name in PACKED and e.guard_type == "TENSOR_MATCH"))
            for e in entries]  # fmt: skip


def median_ms(fn, args: tuple, calls: int = 200) -> float:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def layer_args(batch: int, cache: tuple[torch.Tensor, torch.Tensor]) -> tuple:
    h, rot, slots, positions = inputs(batch)
    return (h, rot, slots, positions, weights, *cache, decode.shape)


if mode == "save":
    cache = (unmarked(k_cache.clone()), unmarked(v_cache.clone()))
    fn = compiled_decode.decode_layer
    fresh = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__)
    start, cpu = time.perf_counter(), time.process_time()
    compiled = torch.compile(fresh, fullgraph=True, dynamic=True, options={"guard_filter_fn": guard_filter})
    artifact = compiled.aot_compile((layer_args(2, cache), {}))
    print(f"aot_compile: {time.perf_counter() - start:.2f} s, {time.process_time() - cpu:.2f} s of CPU")
    artifact.save_compiled_function(path)
    torch.save(artifact(*layer_args(3, cache)), path + ".out")
    today = decode._layer  # traced at every start: batch 1, then batch 2 makes the batch dynamic
    for batch in (1, 2):
        today(*layer_args(batch, (k_cache, v_cache)))
    print(f"batch 8, a layer: today's {median_ms(today, layer_args(8, (k_cache, v_cache))):.3f} ms, "
          f"the artifact's {median_ms(artifact, layer_args(8, cache)):.3f} ms")
else:
    cache = (unmarked(k_cache.clone()), unmarked(v_cache.clone()))
    start, cpu = time.perf_counter(), time.process_time()
    with open(path, "rb") as f:
        artifact = torch.compiler.load_compiled_function(f, f_globals=compiled_decode.decode_layer.__globals__)
    print(f"load: {time.perf_counter() - start:.2f} s, {time.process_time() - cpu:.2f} s of CPU")
    start, cpu = time.perf_counter(), time.process_time()  # a second graph's load: the first one's imports done
    with open(path, "rb") as f:
        torch.compiler.load_compiled_function(f, f_globals=compiled_decode.decode_layer.__globals__)
    print(f"loaded again: {time.perf_counter() - start:.2f} s, {time.process_time() - cpu:.2f} s of CPU")
    same = torch.equal(artifact(*layer_args(3, cache)), torch.load(path + ".out"))
    print(f"the saved output again: {same}; batch 5: {tuple(artifact(*layer_args(5, cache)).shape)}")
