"""`alchemist bench train`: one LoRA training step, recompute vs replay (and transformers + PEFT), per shape.

For each (P prompt tokens, R response tokens) on the model (default SmolLM2-135M-Instruct):
- step time (forward + backward + AdamW) of the recompute path, the replay path, and transformers + PEFT;
- the measured bound: T_recompute / (T_recompute - T_prefill), where T_prefill (the prompt's forward, what replay
  can skip) is timed as a serving prefill of the P tokens; and how much of it replay reaches (speedup / bound,
  and the stricter share of the possible gain, (speedup - 1) / (bound - 1));
- transient peak memory of each step (VmHWM above the RSS before the step, in a fresh process; design note,
  section 10);
- recorded bytes per token vs KV-cache bytes per token, and prefill time with and without recording.
All modes are timed interleaved in one process; medians of --repeats. The recording overhead is timed on its own
after the steps: --prefill-repeats pairs of prefills (plain, then recording in bf16), medians (a prefill takes a
second or less, so the ratio can afford more repeats than the steps; between the steps, it scattered by several
points from run to run).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from alchemist.activations.record import RecordBuilder, RecordingOps, record_bytes_per_token
from alchemist.bench.memory_probe import in_fresh_process, transient_peak_mib
from alchemist.bench.report import interleaved_medians, print_rows
from alchemist.model.attention import AttentionMetadata
from alchemist.model.loader import build_model, hf_dir_for
from alchemist.model.lora import LoraAdapter, LoraConfig
from alchemist.model.seam import COMPUTE
from alchemist.training.recompute import recompute_loss
from alchemist.training.replay import ReplaySample, replay_backward_slices
from alchemist.training.slices import run_to_end

DEFAULT_SHAPES = [(p, r) for p in (128, 512, 1024, 2048) for r in (32, 128, 512)]


def peak_in_subprocess(mode: str, num_prompt: int, num_response: int, model: str | None, record_dtype: str) -> float:
    """Transient peak memory of one step of ``mode``, measured in a fresh process (``memory_probe.py``)."""
    args = (mode, num_prompt, num_response, model, record_dtype)
    return float(in_fresh_process("alchemist.bench.training:memory_probe", *args))


def memory_probe(mode: str, num_prompt: int, num_response: int, model: str | None, record_dtype: str) -> float:
    hf_dir = hf_dir_for(model)
    base = build_model(hf_dir, torch.float32)
    peft_model = build_peft_model(hf_dir, LoraAdapter(base.config, seed=0)) if mode == "peft" else None
    steps = make_steps(base, num_prompt, num_response, getattr(torch, record_dtype), peft_model)
    steps[mode]()  # warm-up: optimizer state and one-time allocations are not transient
    return transient_peak_mib(steps[mode])


def build_peft_model(hf_dir: Path, adapter: LoraAdapter):
    import peft
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    cfg = adapter.config
    lora = peft.LoraConfig(r=cfg.r, lora_alpha=cfg.alpha, target_modules=list(cfg.target_modules), lora_dropout=0.0)
    return peft.get_peft_model(base, lora)


@torch.inference_mode()
def record_prefill(
    model,
    adapter: LoraAdapter | None,
    prompt: torch.Tensor,
    dtype: torch.dtype,
    record_id: str = "bench",
    version: int = 0,
    keep_outputs: bool | None = None,
):
    """The Record of ``prompt`` made by a serving prefill of it alone (the model's recording seam), tagged with
    adapter ``version``. As the engine does, it keeps the forward's outputs where their dtype is the record's
    (``keep_outputs`` None), else copies every row."""
    num_prompt = len(prompt)
    meta = AttentionMetadata.single(num_prompt, need_lse=True)
    keep = dtype == model.dtype if keep_outputs is None else keep_outputs
    builder = RecordBuilder(record_id, prompt.tolist(), version, model.config, dtype, prompt.device, keep_outputs=keep)
    ops = RecordingOps(meta, {0: builder})
    model(prompt, torch.arange(num_prompt, device=prompt.device), meta, ops, adapter)
    ops.finish()
    return builder.build()


def make_steps(
    model,
    num_prompt: int,
    num_response: int,
    record_dtype: torch.dtype,
    peft_model=None,
    lora: LoraConfig | None = None,
) -> dict:
    """The timed functions of one shape: training steps (forward + backward + AdamW) and prefills, of an adapter
    ``lora`` (None: ``LoraConfig()``)."""
    g = torch.Generator().manual_seed(num_prompt * 7 + num_response)
    prompt = torch.randint(0, model.config.vocab_size, (num_prompt,), generator=g).to(model.device)
    response = torch.randint(0, model.config.vocab_size, (num_response,), generator=g).to(model.device)
    adapter = LoraAdapter(model.config, lora, device=model.device, seed=0)

    def prefill(record_as: torch.dtype | None = None):
        if record_as is not None:
            return record_prefill(model, adapter, prompt, record_as)
        with torch.inference_mode():
            positions = torch.arange(num_prompt, device=model.device)
            model(prompt, positions, AttentionMetadata.single(num_prompt), COMPUTE, adapter)

    record = prefill(record_dtype)
    opt = torch.optim.AdamW(adapter.parameters(), lr=1e-5)

    def step_recompute():
        recompute_loss(model, adapter, prompt, response).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def step_replay():
        sample = ReplaySample(prompt, response, lambda layer: record.layers[layer])
        run_to_end(replay_backward_slices(model, adapter, [sample]))
        opt.step()
        opt.zero_grad(set_to_none=True)

    steps = {"recompute": step_recompute, "replay": step_replay, "prefill": prefill}
    steps["prefill_rec_bf16"] = lambda: prefill(torch.bfloat16)
    if peft_model is not None:
        ids = torch.cat([prompt, response])[None]
        labels = ids.clone()
        labels[:, :num_prompt] = -100
        peft_opt = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=1e-5)

        def step_peft():
            peft_model(input_ids=ids, labels=labels).loss.backward()
            peft_opt.step()
            peft_opt.zero_grad(set_to_none=True)

        steps["peft"] = step_peft
    return steps


def run_shape(model, num_prompt: int, num_response: int, args, peft_model) -> dict:
    record_dtype = getattr(torch, args.record_dtype)
    steps = make_steps(model, num_prompt, num_response, record_dtype, peft_model)
    t = interleaved_medians({k: v for k, v in steps.items() if k != "prefill_rec_bf16"}, args.repeats)
    pair = interleaved_medians({k: steps[k] for k in ("prefill", "prefill_rec_bf16")}, args.prefill_repeats)
    bound = t["recompute"] / (t["recompute"] - t["prefill"])
    speedup = t["recompute"] / t["replay"]
    peak = {
        mode: peak_in_subprocess(mode, num_prompt, num_response, args.model, args.record_dtype)
        for mode in ("recompute", "replay", *(("peft",) if peft_model is not None else ()))
    }
    return {
        "P": num_prompt,
        "R": num_response,
        "recompute_s": t["recompute"],
        "replay_s": t["replay"],
        "speedup": speedup,
        "bound": bound,
        "of_bound_pct": 100 * speedup / bound,  # the measure: speedup as a share of the bound
        "of_gain_pct": 100 * (speedup - 1) / (bound - 1) if bound > 1 else float("nan"),  # share of the gain
        "peft_s": t.get("peft", float("nan")),
        "peak_recompute_mib": peak["recompute"],
        "peak_replay_mib": peak["replay"],
        "peak_peft_mib": peak.get("peft", float("nan")),
        "record_kib_per_tok": record_bytes_per_token(model.config, record_dtype) / 1024,
        "kv_kib_per_tok": 2 * model.config.num_layers * model.config.kv_size * record_dtype.itemsize / 1024,
        "prefill_s": pair["prefill"],
        "prefill_rec_bf16_s": pair["prefill_rec_bf16"],
        "rec_overhead_pct": 100 * (pair["prefill_rec_bf16"] / pair["prefill"] - 1),
    }


def main(args: argparse.Namespace) -> int:
    hf_dir = hf_dir_for(args.model)
    model = build_model(hf_dir, torch.float32)
    peft_model = None if args.no_peft else build_peft_model(hf_dir, LoraAdapter(model.config, seed=0))
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes] if args.shapes else DEFAULT_SHAPES
    rows = []
    for num_prompt, num_response in shapes:
        rows.append(run_shape(model, num_prompt, num_response, args, peft_model))
        print_rows(rows[-1:], as_json=True, out=sys.stderr)  # progress: a full run takes a while
    print_rows(rows, args.json)
    return 0
