"""Profile (not a benchmark): how long the online trainer's slices take, by kind, on `bench online`'s workload.

    python docs/profiles/online_slices.py [replay|recompute] [group size] [group max tokens]   # replay 4 2048

A slice is what serving waits for when a step is due (alchemist.runtime.async_engine): the longest ones bound how
much a training turn can stretch a decode step. In process, as `alchemist serve --dtype auto` with `bench
online`'s defaults runs it (the model in bf16 on a CPU that runs bf16 fast, else fp32; bf16 records; the training
defaults: the evaluation gate, protected directions, anchors, rehearsal): the workload's 48 prompts are served
first (greedy, recorded, each completion offered as an anchor), the 24 corrections written to a feedback log, then
the trainer runs slice after slice with no serving in between until the log is trained. Each slice is labelled by
where the trainer's generator stopped (its innermost function and line).
"""

import argparse
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from alchemist.bench.online import build_workload
from alchemist.config import EngineConfig, OnlineConfig, RecordConfig, TrainerConfig
from alchemist.config.training import QueueConfig
from alchemist.engine import LLMEngine, SamplingParams
from alchemist.feedback.sqlite_log import SQLiteFeedbackLog
from alchemist.host_memory import keep_freed_memory
from alchemist.model.loader import load_model
from alchemist.training.anchors import Anchor
from alchemist.training.checkpoint import AdapterCheckpoints
from alchemist.training.online import OnlineTrainer

mode = sys.argv[1] if len(sys.argv) > 1 else "replay"
group_size = int(sys.argv[2]) if len(sys.argv) > 2 else 4
group_max_tokens = int(sys.argv[3]) if len(sys.argv) > 3 else TrainerConfig.group_max_tokens
keep_freed_memory()
loaded = load_model(None, dtype="auto")
tok = loaded.tokenizer
defaults = argparse.Namespace(num_requests=48, seed=0, mode="multi_turn", max_prompt_tokens=768, max_tokens=128,
                              request_rate=0.4, feedback_fraction=0.5, feedback="correction")  # fmt: skip
work = build_workload(defaults, tok)
engine = LLMEngine(loaded.model, tok, EngineConfig(max_num_seqs=16, max_model_len=904), RecordConfig())
served: dict[str, tuple[list[int], list[int]]] = {}
t0 = time.perf_counter()
for i, (chat, max_tokens) in enumerate(zip(work.chats, work.max_tokens, strict=True)):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, record=True)
    engine.add_request(f"r{i}", tok.apply_chat_template(chat), params)
while engine.has_unfinished():
    for out in engine.step():
        if out.finished:
            served[out.request_id] = (out.prompt_token_ids, out.output_token_ids)
recorded = sum(rid in engine.store for rid in served)
print(f"served {len(served)} requests in {time.perf_counter() - t0:.1f} s; records: {recorded}", flush=True)

data = Path(tempfile.mkdtemp())
log = SQLiteFeedbackLog(data / "feedback.db")
config = OnlineConfig(  # the defaults, but every correction queued at once
    queue=QueueConfig(max_wait_s=0.0),
    trainer=TrainerConfig(replay=mode == "replay", group_size=group_size, group_max_tokens=group_max_tokens),
)
trainer = OnlineTrainer.from_config(engine.model, engine.tokenizer, engine, engine.store, log,
                                    AdapterCheckpoints(data / "adapters", config.adapter.keep_versions), config)
for i, fb in enumerate(work.feedback):
    prompt_ids, output_ids = served[f"r{i}"]
    if fb is None:
        trainer.anchors.offer(Anchor(f"r{i}", prompt_ids, output_ids))
        continue
    log.append(response_id=f"r{i}", kind="sft", prompt_token_ids=prompt_ids,
               response_token_ids=tok.encode_reply(fb["correction"]), output_token_ids=output_ids,
               adapter_version=0, recorded=True, correction=fb["correction"])  # fmt: skip


def where(job) -> str:
    while True:  # down the generators (a wrapper that calls next() on one keeps it in its local "slices", and
        # torch's no_grad on a generator function in its local "gen")
        local = job.gi_frame.f_locals if job.gi_frame is not None else {}
        inner = job.gi_yieldfrom or local.get("slices") or local.get("gen")
        if not hasattr(inner, "gi_frame"):
            break
        job = inner
    frame = getattr(job, "gi_frame", None)
    return "end of batch" if frame is None else f"{job.gi_code.co_name}:{frame.f_lineno}"


slices: dict[str, list[float]] = defaultdict(list)
order: list[tuple[str, float]] = []
t0 = time.perf_counter()
while trainer.has_work():
    took = trainer.run_slice()
    label = "end of batch" if trainer._job is None else where(trainer._job)
    slices[label].append(took)
    order.append((label, took))
total = time.perf_counter() - t0
every = [s for v in slices.values() for s in v]
p90 = statistics.quantiles(every, n=10, method="inclusive")[-1]
print(f"{mode}, groups of {group_size} ({group_max_tokens} tokens): {len(every)} slices in {total:.1f} s; p50 "
      f"{statistics.median(every) * 1e3:.0f} ms, p90 {p90 * 1e3:.0f} ms, max {max(every) * 1e3:.0f} ms; replayed "
      f"{trainer.stats.replayed}, recomputed {trainer.stats.recomputed}")  # fmt: skip
print(f"{'stopped at':40} {'count':>5} {'total s':>8} {'median ms':>9} {'p90 ms':>8} {'max ms':>8}")
for label, v in sorted(slices.items(), key=lambda kv: -max(kv[1])):
    p90 = statistics.quantiles(v, n=10, method="inclusive")[-1] if len(v) > 1 else v[0]
    print(f"{label:40} {len(v):5} {sum(v):8.2f} {statistics.median(v) * 1e3:9.0f} {p90 * 1e3:8.0f} {max(v) * 1e3:8.0f}")
longest = sorted(range(len(order)), key=lambda i: -order[i][1])[:8]
print(
    "longest slices (index in the run, where it stopped, ms):",
    ", ".join(f"#{i} {order[i][0]} {order[i][1] * 1e3:.0f}" for i in sorted(longest)),
)
