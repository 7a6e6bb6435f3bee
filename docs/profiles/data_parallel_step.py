"""Profile (not a benchmark): a data-parallel step's collectives against the step, two replicas on this machine.

    python docs/profiles/data_parallel_step.py 2 128 32 6 replay      # replicas, P, R, steps, replay|recompute

Each replica (a spawned process, one thread, gloo through a file) takes ``steps`` steps of SmolLM2 fp32 with a
rank-16 adapter over two samples of its own (P prompt and R response tokens, random ids; each prompt its own
record). Per step after the first (warm-up): the step's time and its collectives' (the count exchange and the
all-reduce of the gradients, waits for the other replica included), medians, and the gradient buffer's size.
"""

import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from alchemist.activations.store import ActivationStore
from alchemist.bench.training import record_prefill
from alchemist.model.loader import build_model, hf_dir_for
from alchemist.model.lora import LoraAdapter
from alchemist.training.data_parallel import DataParallel
from alchemist.training.slices import run_to_end
from alchemist.training.trainer import Sample, Trainer, TrainerConfig


def replica(rank: int, world_size: int, rendezvous: str, P: int, R: int, steps: int, replay: bool) -> None:
    torch.set_num_threads(1)
    data_parallel = DataParallel.join(rendezvous, rank, world_size, torch.device("cpu"), timeout_s=300)
    model = build_model(hf_dir_for(None), torch.float32)
    adapter = LoraAdapter(model.config, seed=0)
    store = ActivationStore(budget_bytes=1 << 32)
    g = torch.Generator().manual_seed(rank)
    vocab = model.config.vocab_size
    samples = []
    for i in range(2):
        prompt, response = torch.randint(0, vocab, (P,), generator=g), torch.randint(0, vocab, (R,), generator=g)
        store.put(record_prefill(model, adapter, prompt, torch.float32, f"r{rank}-{i}", 0, None))
        samples.append(Sample(prompt.tolist(), response.tolist(), record_id=f"r{rank}-{i}"))
    trainer = Trainer(model, adapter, store, TrainerConfig(replay=replay, max_staleness=steps), data_parallel)
    step_s, allreduce_s = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        result = run_to_end(trainer.step_slices(samples))
        step_s.append(time.perf_counter() - t0)
        allreduce_s.append(result.allreduce_s)
    values = sum(p.numel() for p in adapter.parameters())
    s, a = statistics.median(step_s[1:]), statistics.median(allreduce_s[1:])
    print(f"rank {rank}: step {s * 1e3:.0f} ms, collectives {a * 1e3:.1f} ms ({a / s:.1%}), gradient buffer "
          f"{values * 4 / 1e6:.1f} MB, replayed {trainer.stats.replayed} of {steps * len(samples)}", flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    world_size, P, R, steps = (int(a) for a in sys.argv[1:5])
    replay = sys.argv[5] == "replay" if len(sys.argv) > 5 else True
    rendezvous = f"file://{Path(tempfile.mkdtemp()) / 'rendezvous'}"
    mp.spawn(replica, (world_size, rendezvous, P, R, steps, replay), nprocs=world_size)
