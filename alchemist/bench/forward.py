"""`alchemist bench forward`: prefill time of one prompt, ours vs transformers on the same weights.

Both models read the same HF directory (the default GGUF is converted once into the cache). Modes are timed
interleaved in one process and the median of ``--repeats`` runs is reported, so the ratio holds on a noisy machine.
"""

from __future__ import annotations

import argparse
import platform

import torch

from alchemist.bench.report import interleaved_medians, print_rows
from alchemist.model.attention import AttentionMetadata
from alchemist.model.loader import build_model, hf_dir_for, resolve_device, resolve_dtype


def main(args: argparse.Namespace) -> int:
    import transformers

    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    hf_dir = hf_dir_for(args.model)
    ours = build_model(hf_dir, dtype, device)
    ref = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).to(device).eval()
    rows = []
    for n in args.prompt_tokens:
        ids = torch.randint(0, ours.config.vocab_size, (n,), generator=torch.Generator().manual_seed(n)).to(device)
        meta = AttentionMetadata.single(n)
        positions = torch.arange(n, device=device)

        @torch.inference_mode()
        def run_ours(ids=ids, positions=positions, meta=meta) -> None:
            # Serving needs the last position's logits only; so does transformers with logits_to_keep=1.
            ours.logits(ours(ids, positions, meta)[-1:])

        @torch.inference_mode()
        def run_ref(ids=ids) -> None:
            ref(ids[None], logits_to_keep=1)

        t = interleaved_medians({"ours": run_ours, "transformers": run_ref}, repeats=args.repeats)
        rows.append(
            {
                "prompt_tokens": n,
                "dtype": str(dtype).removeprefix("torch."),
                "device": str(device),
                "ours_s": t["ours"],
                "transformers_s": t["transformers"],
                "speedup": t["transformers"] / t["ours"],
                "ours_tok_per_s": n / t["ours"],
                "threads": torch.get_num_threads(),
                "cpu": platform.processor() or platform.machine(),
            }
        )
    print_rows(rows, args.json)
    return 0
