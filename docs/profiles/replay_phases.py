"""Profile (not a benchmark): where a replay step's time goes, in CPU time with 1 thread.

    python docs/profiles/replay_phases.py 512 32

Prints the medians of 3 steps of recompute, prefill and replay (the functions ``bench train`` times, on SmolLM2,
fp32 model and records), the bound's replay time (recompute - prefill), and the replay's phases: the live
forward (including the prompt K/V and the loss), the loss's backward, and the walk.
"""

import statistics
import sys
import time

import torch

import alchemist.training.replay as replay
from alchemist.bench.training import make_steps
from alchemist.model.loader import build_model, hf_dir_for

torch.set_num_threads(1)
P, R = int(sys.argv[1]), int(sys.argv[2])
model = build_model(hf_dir_for(None), torch.float32)
steps = make_steps(model, P, R, torch.float32)
phases: dict[str, list[float]] = {"live_forward": [], "loss_backward": [], "walk": []}


def timed_run_to_end(slices):
    """replay.run_to_end, timing the slices: the live forward's layers (the last with the loss), the loss's
    backward, then the walk's layers."""
    names = ["live_forward"] * model.config.num_layers + ["loss_backward"]
    spent, t = {"walk": 0.0}, time.process_time()
    while True:
        try:
            next(slices)
        except StopIteration as done:
            spent["walk"] += time.process_time() - t
            for name, seconds in spent.items():
                phases[name].append(seconds)
            return done.value
        now = time.process_time()
        name = names.pop(0) if names else "walk"
        spent[name] = spent.get(name, 0.0) + now - t
        t = now


replay.run_to_end = timed_run_to_end
totals: dict[str, list[float]] = {name: [] for name in ("recompute", "prefill", "replay")}
for name in totals:
    steps[name]()  # warm-up
for name in phases:
    phases[name].clear()
for _ in range(3):
    for name in totals:
        t = time.process_time()
        steps[name]()
        totals[name].append(time.process_time() - t)
med = {name: statistics.median(v) for name, v in {**totals, **phases}.items()}
med["bound_replay"] = med["recompute"] - med["prefill"]
print(f"P={P} R={R}", {name: round(v, 3) for name, v in med.items()})
