"""Decode throughput of the engine alone (no HTTP), at a few batch sizes; optionally a profile of one step.

    python -m alchemist.bench.decode --batch 1 8 32 --context 256 --steps 64 [--dtype bfloat16]
    python -m alchemist.bench.decode --batch 8 --profile      # torch.profiler table of decode steps

Each run fills the batch with random prompts of ``--context`` tokens, steps until every request has its first
token, then times ``--steps`` steps in which all requests decode: tokens/s = batch * steps / seconds.
"""

from __future__ import annotations

import argparse
import time

import torch

from alchemist.config import EngineConfig
from alchemist.engine.engine import LLMEngine
from alchemist.engine.sequence import SamplingParams
from alchemist.host_memory import keep_freed_memory


def decode_tokens_per_s(engine: LLMEngine, batch: int, context: int, steps: int, profile: bool = False) -> float:
    g = torch.Generator().manual_seed(0)
    vocab = engine.model.config.vocab_size
    params = SamplingParams(temperature=0, ignore_eos=True)  # runs to max_model_len
    for i in range(batch):
        engine.add_request(f"bench-{batch}-{i}", torch.randint(0, vocab, (context,), generator=g).tolist(), params)
    while engine.stats().num_running < batch or any(s.num_uncomputed_tokens > 1 for s in engine.scheduler.running):
        engine.step()
    for _ in range(3):  # warm-up decode steps
        engine.step()
    if profile:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                engine.step()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    start = time.perf_counter()
    for _ in range(steps):
        outs = engine.step()
        assert len(outs) == batch, "every request must decode in every timed step"
    elapsed = time.perf_counter() - start
    for i in range(batch):
        engine.abort(f"bench-{batch}-{i}")
    engine.step()
    return batch * steps / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = parser.parse_args()
    keep_freed_memory()  # this process owns the allocator, as the server's does (host_memory.py)
    if args.threads:
        torch.set_num_threads(args.threads)
    config = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device="cpu",
        max_num_seqs=max(args.batch),
        # Room for the decode steps taken while the rest of the batch is still prefilling, and the timed ones.
        max_model_len=args.context + args.steps + 16 + max(args.batch) * args.context // 512,
    )
    engine = LLMEngine.from_config(config)
    print(f"model dtype {engine.model.dtype}, threads {torch.get_num_threads()}, context {args.context}")
    for batch in args.batch:
        rate = decode_tokens_per_s(engine, batch, args.context, args.steps, args.profile)
        print(f"batch {batch:3d}: {rate:7.1f} decode tokens/s ({1000 * batch / rate:.1f} ms/step)")


if __name__ == "__main__":
    main()
