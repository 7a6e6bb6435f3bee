"""Profile (not a benchmark): a decode step whose rows are spread over many adapters, their deltas one adapter at a
time (``AdapterRows``) vs grouped (``GroupedRows``), beside the base model's step.

    OMP_NUM_THREADS=2 python docs/profiles/adapter_groups.py [rounds] [batch] [context] [compiled]
                                                         # defaults: 20 32 256; "compiled": the compiled steps too

SmolLM2 in the dtype the server picks (bf16 here, packed linears where they apply), ``batch`` decode rows at
``context`` tokens each (the cache holds zeros: attention costs the same), eager ``Llama.forward``. Adapters as
`alchemist bench serve --adapters` makes them (rank 16, alpha 32, every projection, random B). The rows go round
robin over K adapters, K = 1, 4, 16; per K the step with each adapter object, the row layout built inside the timed
step as the runner builds it. Each round runs every case once, interleaved; prints the median of each (ms) and its
cost over the base step. K = 1 is what the runner serves a step of one named adapter with: its delta alone. With
"compiled", also the compiled layer's step (``CompiledDecode``, warmed up first) of the base model and of K = 4 and
16 grouped (its first grouped step compiles, in the warm-up rounds).
"""

import statistics
import sys
import time

import torch

from alchemist.bench.serve_adapters import ALPHA, B_STD, RANK, SEED
from alchemist.engine.adapter_groups import GroupedRows
from alchemist.engine.adapter_rows import AdapterRows
from alchemist.engine.adapter_slots import AdapterSlots
from alchemist.engine.compiled_decode import CompiledDecode
from alchemist.engine.packed_ops import PackedLinearOps, packed_linear_supported
from alchemist.engine.served_adapter import ServedAdapter
from alchemist.host_memory import keep_freed_memory
from alchemist.model.attention import AttentionMetadata, KVCache, Segment
from alchemist.model.loader import load_model
from alchemist.model.lora import ALL_TARGETS, LoraAdapter, LoraConfig
from alchemist.model.seam import COMPUTE

keep_freed_memory()
ROUNDS, BATCH, CONTEXT = [int(a) for a in sys.argv[1:4]] + [20, 32, 256][len(sys.argv[1:4]) :]
COMPILED = "compiled" in sys.argv[4:]
model = load_model(None, dtype="auto", device="cpu").model
c = model.config
ops = PackedLinearOps(model) if packed_linear_supported(model) else COMPUTE
cache = KVCache(c.num_layers, BATCH, CONTEXT + 8, c.num_kv_heads, c.head_dim, model.dtype, model.device)
adapters = []
for i in range(16):
    lora = LoraAdapter(c, LoraConfig(r=RANK, alpha=ALPHA, target_modules=ALL_TARGETS), seed=SEED + i)
    g = torch.Generator().manual_seed(SEED + i)
    with torch.no_grad():
        for b in lora.B.values():
            b.copy_(torch.randn(b.shape, generator=g) * B_STD)
    adapters.append(ServedAdapter(lora, model.dtype, model.device))
slots = AdapterSlots(c, model.dtype, model.device)
ids = torch.randint(0, c.vocab_size, (BATCH,), generator=torch.Generator().manual_seed(0))
positions = torch.full((BATCH,), CONTEXT, dtype=torch.long)
ones = [1] * BATCH


compiled = CompiledDecode.create_warm(model, cache, True, isinstance(ops, PackedLinearOps), ops) if COMPILED else None
slot_ids = torch.arange(BATCH)


def step(rows_of, compile_it: bool = False) -> None:
    """One decode step of every row; ``rows_of()`` makes the adapter object (inside the time, as the runner)."""
    meta = AttentionMetadata([Segment(slot=i, start=CONTEXT, length=1) for i in range(BATCH)], cache=cache)
    if compile_it:
        compiled.forward(ids, positions, slot_ids, meta.max_position, ops, rows_of())
    else:
        model(ids, positions, meta, ops, rows_of())


def spread(k: int) -> list[ServedAdapter]:
    return [adapters[i % k] for i in range(BATCH)]


cases = {"base": lambda: None, "1 adapter": lambda: adapters[0]}
for k in (4, 16):
    cases[f"{k} adapters, one at a time"] = lambda k=k: AdapterRows.of(spread(k), ones, [], model.device)
    cases[f"{k} adapters, grouped"] = lambda k=k: GroupedRows.of(slots, spread(k), ones, [], adapters, model.device)
if COMPILED:
    cases["base, compiled"] = lambda: None
    for k in (4, 16):
        cases[f"{k} adapters, grouped, compiled"] = cases[f"{k} adapters, grouped"]
times: dict[str, list[float]] = {case: [] for case in cases}
with torch.inference_mode():
    for r in range(ROUNDS + 2):  # two rounds of warm-up (oneDNN primitives, the slots copied in)
        for case, rows_of in cases.items():
            t0 = time.perf_counter()
            step(rows_of, case.endswith("compiled"))
            if r >= 2:
                times[case].append(time.perf_counter() - t0)
med = {case: 1e3 * statistics.median(ts) for case, ts in times.items()}
print(f"{model.dtype}, {BATCH} decode rows at {CONTEXT} tokens, {torch.get_num_threads()} threads, median of {ROUNDS}:")
for case, ms in med.items():
    print(f"  {case:28s} {ms:7.1f} ms  ({ms / med['base']:.2f}x base)")
