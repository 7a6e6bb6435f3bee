"""Profile (not a benchmark): the most replay can gain over recompute on `bench online`'s workload, and what it gets.

    python docs/profiles/online_bound.py [repeats] [group size] [ops] [dtype] [max prompt tokens]
                                                                  # defaults: 3, 4, no ops, auto, 768

``ops``: then one more pass of each path under torch.profiler: self CPU time by op, and the matmuls by kind.

The samples `alchemist bench online` trains with its defaults (its ``build_workload``: 48 ShareGPT multi-turn
conversations, seed 0, prompts of at most 768 tokens or ``max prompt tokens``, a correction of at most 128 tokens on
half of them), trained as the server trains them (SmolLM2 in the dtype `--dtype auto` picks on this machine unless
one is given, bf16 records, LoRA r=16, groups of ``group size``), in process, without serving, anchors, updates or
publishes. Times, interleaved over ``repeats`` (medians): ``recompute`` (all samples' backward with no store),
``replay`` (with every prompt's record in memory), and the training forward in the same groups with and without the
prompt rows (each sample from its prompt's last token on): their difference is the share of the recompute step that
replay can skip. As `bench train` defines it (with a prefill there), bound = recompute / (recompute - that share):
replay / recompute throughput can reach it only if everything replay does besides skipping the prompt's forward
costs nothing.
"""

import argparse
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from alchemist.activations.store import ActivationStore
from alchemist.bench.online import build_workload
from alchemist.bench.training import record_prefill
from alchemist.host_memory import keep_freed_memory
from alchemist.model.loader import load_model
from alchemist.model.lora import LoraAdapter
from alchemist.training.recompute import responses_hidden_slices
from alchemist.training.slices import run_to_end
from alchemist.training.trainer import Sample, Trainer, TrainerConfig

repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 3
group_size = int(sys.argv[2]) if len(sys.argv) > 2 else 4
ops = len(sys.argv) > 3 and sys.argv[3] == "ops"
dtype = sys.argv[4] if len(sys.argv) > 4 else "auto"
max_prompt_tokens = int(sys.argv[5]) if len(sys.argv) > 5 else 768  # bench online's --max-prompt-tokens
keep_freed_memory()  # as the CLI does
loaded = load_model(None, dtype=dtype)
model, tok = loaded.model, loaded.tokenizer
defaults = argparse.Namespace(num_requests=48, seed=0, mode="multi_turn", max_prompt_tokens=max_prompt_tokens,
                              max_tokens=128, request_rate=0.4, feedback_fraction=0.5,
                              feedback="correction")  # fmt: skip
work = build_workload(defaults, tok)
samples = [
    Sample(tok.apply_chat_template(chat), tok.encode_reply(fb["correction"]), record_id=f"r{i}")
    for i, (chat, fb) in enumerate(zip(work.chats, work.feedback, strict=True))
    if fb is not None
]
prompt_tokens = [len(s.prompt_ids) for s in samples]
response_tokens = [len(s.response_ids) for s in samples]
print(f"SmolLM2 in {model.dtype}; {len(samples)} samples: prompt tokens mean "
      f"{statistics.mean(prompt_tokens):.0f} (median {statistics.median(prompt_tokens):.0f}, max "
      f"{max(prompt_tokens)}), response tokens mean {statistics.mean(response_tokens):.0f}", flush=True)  # fmt: skip
adapter = LoraAdapter(model.config, seed=0)
store = ActivationStore(8 << 30)
for s in samples:
    store.put(record_prefill(model, adapter, torch.tensor(s.prompt_ids), torch.bfloat16, s.record_id))
scales = [1.0 / len(samples)] * len(samples)


def train(with_store: bool) -> None:
    trainer = Trainer(model, adapter, store if with_store else None, TrainerConfig(group_size=group_size))
    results = run_to_end(trainer.backward_slices(samples, scales))
    assert all(replayed == with_store for _, replayed in results)
    adapter.zero_grad(set_to_none=True)


@torch.inference_mode()
def forward(prompt_rows: bool) -> None:
    """The training forward's, in the groups the trainer makes: each sample's P + R - 1 rows, or (without the
    prompt rows) the R rows from the prompt's last token on."""
    for start in range(0, len(samples), group_size):
        group = [(torch.tensor(s.prompt_ids if prompt_rows else s.prompt_ids[-1:]), torch.tensor(s.response_ids))
                 for s in samples[start : start + group_size]]  # fmt: skip
        run_to_end(responses_hidden_slices(model, adapter, group))


runs = {
    "recompute": lambda: train(False),
    "replay": lambda: train(True),
    "forward": lambda: forward(True),
    "forward_no_prompt": lambda: forward(False),
}
times: dict[str, list[float]] = {name: [] for name in runs}
for fn in runs.values():
    fn()  # warm-up
for _ in range(repeats):
    for name, fn in runs.items():
        t0 = time.perf_counter()
        fn()
        times[name].append(time.perf_counter() - t0)
t = {name: statistics.median(v) for name, v in times.items()}
prompt_share = t["forward"] - t["forward_no_prompt"]
bound = t["recompute"] / (t["recompute"] - prompt_share)
speedup = t["recompute"] / t["replay"]
print(f"group size {group_size}, medians of {repeats}: recompute {t['recompute']:.2f} s, replay {t['replay']:.2f} s")
print(f"forward {t['forward']:.2f} s, without the prompt rows {t['forward_no_prompt']:.2f} s: prompt share "
      f"{prompt_share:.2f} s")  # fmt: skip
print(f"replay / recompute {speedup:.3f}, bound {bound:.3f} ({100 * speedup / bound:.1f}% of it)")


def matmuls_by_kind(prof) -> dict[str, list[float]]:
    """Matmul self time, calls and GFLOP by kind: "rank<=16" (LoRA's products), "base" (the base weights and the
    LM head: both weight dims >= 192), "other"."""
    kinds: dict[str, list[float]] = {}
    for e in prof.key_averages(group_by_input_shape=True):
        if e.key not in ("aten::mm", "aten::addmm_", "aten::addmm") or len(e.input_shapes) < 2:
            continue
        (m, k), (_, n) = e.input_shapes[-2][:2], e.input_shapes[-1][:2]
        kind = "rank<=16" if min(m, k, n) <= 16 else "base" if min(k, n) >= 192 else "other"
        row = kinds.setdefault(kind, [0.0, 0, 0.0])
        row[0] += e.self_cpu_time_total / 1e6
        row[1] += e.count
        row[2] += 2 * m * k * n * e.count / 1e9
    return kinds


if ops:
    self_s = {}
    for name in ("recompute", "replay"):
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            runs[name]()
        self_s[name] = {e.key: (e.self_cpu_time_total / 1e6, e.count) for e in prof.key_averages()}
        for kind, (secs, calls, gflop) in sorted(matmuls_by_kind(prof).items()):
            print(f"{name} matmuls, {kind}: {secs:.2f} s, {calls} calls, {gflop:.1f} GFLOP, {gflop / secs:.1f} GFLOP/s")
    print("self CPU s (calls): " + ", ".join(f"{n} {sum(v[0] for v in d.values()):.2f}" for n, d in self_s.items()))
    top = sorted(set().union(*self_s.values()), key=lambda k: -max(d.get(k, (0, 0))[0] for d in self_s.values()))
    for key in top[:12]:
        cells = "   ".join(f"{n} {d.get(key, (0, 0))[0]:6.2f} ({d.get(key, (0, 0))[1]:6})" for n, d in self_s.items())
        print(f"{key[:58]:58} {cells}")
