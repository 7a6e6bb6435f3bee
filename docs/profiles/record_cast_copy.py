"""Profile (not a benchmark): the cost of the copies alone that make a bf16 record from an fp32 prefill.

    python docs/profiles/record_cast_copy.py 512      # prompt tokens

SmolLM2's recorded widths per layer (h 576, qkv 960, attn 576, o 576, gate_up 3,072 values per token), fp32 rows
cast-copied into bf16 buffers allocated once, for 30 layers, 2 threads, median of 11: the memory traffic a
recording prefill adds, without the prefill around it.
"""

import sys

import torch

from alchemist.bench.report import interleaved_medians

torch.set_num_threads(2)
tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 512
widths = (576, 960, 576, 576, 3072)
sources = [torch.randn(tokens, w) for w in widths]
buffers = [torch.empty(tokens, w, dtype=torch.bfloat16) for w in widths]


def record_all_layers() -> None:
    for _ in range(30):
        for src, dst in zip(sources, buffers, strict=True):
            dst.copy_(src)


seconds = interleaved_medians({"copies": record_all_layers}, 11)["copies"]
mb = 30 * tokens * sum(widths) * (4 + 2) / 1e6
print(f"{tokens} tokens: {mb:.0f} MB read + written, median {1e3 * seconds:.1f} ms")
