"""Profile (not a test): what the preference ranks cost a training step and a recorded prefill.

    PYTHONPATH=. python docs/profiles/preference_ranks_cost.py [--shapes 512x128 1024x128] [--repeats 7]

The online trainer's adapter has ``lora_r + preference_r`` ranks (16 + 8 by default; alchemist.training.rank_split).
Decode serves it merged (no cost); a recorded prefill adds its delta unmerged, and a training step carries its
parameters, gradients and AdamW state. This times ``bench train``'s steps (alchemist.bench.training.make_steps:
replay, recompute, and a prefill recording bf16) for the adapter with and without the preference ranks, interleaved
in one process (medians), on SmolLM2 in fp32 as ``bench train`` runs it.
"""

from __future__ import annotations

import argparse
import json

import torch

from alchemist.bench.report import interleaved_medians
from alchemist.bench.training import make_steps
from alchemist.config.training import AdapterConfig
from alchemist.model.loader import build_model, hf_dir_for
from alchemist.training.lineage import adapter_config


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["512x128", "1024x128"])
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    model = build_model(hf_dir_for(None), torch.float32)
    configs = {"without": adapter_config(AdapterConfig(preference_r=0)), "with": adapter_config(AdapterConfig())}
    for shape in args.shapes:
        p, r = map(int, shape.split("x"))
        fns = {}
        for name, lora in configs.items():
            steps = make_steps(model, p, r, torch.bfloat16, lora=lora)
            fns |= {f"{kind}_{name}": steps[kind] for kind in ("replay", "recompute", "prefill_rec_bf16")}
        t = interleaved_medians(fns, args.repeats)
        row = {"P": p, "R": r, "r": {k: c.r for k, c in configs.items()}, **{k: round(v, 4) for k, v in t.items()}}
        for kind in ("replay", "recompute", "prefill_rec_bf16"):
            row[f"{kind}_cost_pct"] = round(100 * (t[f"{kind}_with"] / t[f"{kind}_without"] - 1), 1)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
