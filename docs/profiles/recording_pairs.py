"""Profile (not a benchmark): how much `bench train`'s recording-overhead pairs scatter within one process.

    python docs/profiles/recording_pairs.py 512 32      # P, R

``bench train``'s step functions at one shape (SmolLM2, fp32 model, the CLI's memory setting, 2 threads): 9
interleaved pairs of prefills (plain, then recording in bf16), medians and the overhead; then two training steps
of each path, as ``bench train`` runs before its pairs; then the pairs twice more.
"""

import sys

import torch

from alchemist.bench.report import interleaved_medians
from alchemist.bench.training import make_steps
from alchemist.host_memory import keep_freed_memory
from alchemist.model.loader import build_model, hf_dir_for

assert keep_freed_memory()
P, R = int(sys.argv[1]), int(sys.argv[2])
steps = make_steps(build_model(hf_dir_for(None), torch.float32), P, R, torch.float32)


def pairs(tag: str) -> None:
    t = interleaved_medians({k: steps[k] for k in ("prefill", "prefill_rec_bf16")}, 9)
    overhead = 100 * (t["prefill_rec_bf16"] / t["prefill"] - 1)
    print(tag, {k: round(v, 4) for k, v in t.items()}, f"overhead {overhead:+.2f}%", flush=True)


pairs("fresh")
for _ in range(2):
    steps["recompute"]()
    steps["replay"]()
pairs("after steps")
pairs("again")
