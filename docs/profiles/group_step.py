"""Profile (not a benchmark): samples trained together (one walk, one forward) against the same samples one at a time.

    python docs/profiles/group_step.py 250 64 4 5 bfloat16      # P, R, samples, repeats, model and record dtype

G samples of P prompt and R response tokens (random ids, each prompt its own record made by a serving prefill),
SmolLM2, torch's default threads: the gradients of all G (no optimizer step), replayed one at a time and together
(``replay_backward_slices`` of all G), recomputed one at a time and together (``recompute_losses``), interleaved;
medians, per sample, and the ratios.
"""

import statistics
import sys
import time

import torch

from alchemist.bench.training import record_prefill
from alchemist.model.loader import build_model, hf_dir_for
from alchemist.model.lora import LoraAdapter
from alchemist.training.recompute import recompute_loss, recompute_losses
from alchemist.training.replay import ReplaySample, replay_backward_slices
from alchemist.training.slices import run_to_end

P, R, G, repeats = (int(a) for a in sys.argv[1:5])
dtype = getattr(torch, sys.argv[5]) if len(sys.argv) > 5 else torch.float32
model = build_model(hf_dir_for(None), dtype)
adapter = LoraAdapter(model.config, seed=0)
g = torch.Generator().manual_seed(0)
vocab = model.config.vocab_size
samples = [(torch.randint(0, vocab, (P,), generator=g), torch.randint(0, vocab, (R,), generator=g)) for _ in range(G)]
records = [record_prefill(model, adapter, prompt, dtype) for prompt, _ in samples]


def replay_alone():
    for (prompt, response), record in zip(samples, records, strict=True):
        sample = ReplaySample(prompt, response, record.layers.__getitem__, loss_scale=1.0 / G)
        run_to_end(replay_backward_slices(model, adapter, [sample]))


def replay_together():
    pairs = zip(samples, records, strict=True)
    group = [ReplaySample(p, r, rec.layers.__getitem__, loss_scale=1.0 / G) for (p, r), rec in pairs]
    run_to_end(replay_backward_slices(model, adapter, group))


def recompute_alone():
    for prompt, response in samples:
        (recompute_loss(model, adapter, prompt, response) / G).backward()


def recompute_together():
    sum(recompute_losses(model, adapter, [(p, r, None) for p, r in samples])).div(G).backward()


modes = {f.__name__: f for f in (replay_alone, replay_together, recompute_alone, recompute_together)}
times: dict[str, list[float]] = {name: [] for name in modes}
for fn in modes.values():
    fn()  # warm-up
for _ in range(repeats):
    for name, fn in modes.items():
        adapter.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        fn()
        times[name].append(time.perf_counter() - t0)
med = {name: statistics.median(v) for name, v in times.items()}
print(f"P={P} R={R} G={G} {dtype} threads={torch.get_num_threads()}; ms per sample:",
      {name: round(1e3 * s / G, 1) for name, s in med.items()})  # fmt: skip
print(f"together / alone speedup: replay {med['replay_alone'] / med['replay_together']:.2f}x, "
      f"recompute {med['recompute_alone'] / med['recompute_together']:.2f}x; replay / recompute speedup: "
      f"alone {med['recompute_alone'] / med['replay_alone']:.2f}x, "
      f"together {med['recompute_together'] / med['replay_together']:.2f}x")  # fmt: skip
