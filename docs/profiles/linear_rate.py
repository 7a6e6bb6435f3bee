"""Profile (not a benchmark): the packed oneDNN bf16 linear's rate at decode batch sizes, weights in cache vs streamed.

    python docs/profiles/linear_rate.py

SmolLM2's fused gate/up projection (3,072 x 576, bf16, packed as ``alchemist.engine.packed_ops`` packs it), 2
threads, median of 30: one weight called again and again (it stays in the CPU's caches), then 30 different weights
in turn (each read from memory, as a decode step reads its layers). The two are timed one after the other, not
interleaved (``bench.report.interleaved_medians``): interleaving evicts the cached weight between its calls.
"""

import statistics
import time

import torch

from alchemist.engine.packed_ops import pack, packed_linear

torch.set_num_threads(2)
OUT, IN = 3072, 576


def median_us(fn, repeats: int = 30) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


weights = [pack(torch.randn(OUT, IN).bfloat16()) for _ in range(30)]
for m in (1, 8, 16, 32, 64, 128):
    x = torch.randn(m, IN).bfloat16()
    cached = median_us(lambda x=x: packed_linear(x, weights[0], None))
    streamed = median_us(lambda x=x: [packed_linear(x, w, None) for w in weights]) / len(weights)
    flop = 2 * m * OUT * IN
    print(
        f"M={m:4d}: in cache {cached:7.0f} us ({flop / cached / 1e3:4.0f} GFLOP/s), "
        f"streamed {streamed:7.0f} us ({flop / streamed / 1e3:4.0f} GFLOP/s)"
    )
