"""`alchemist bench learn --parts throughput`: training samples per second of SFT, KTO and DPO mini-batches,
replayed from serving's records vs recomputed.

The same ``--throughput-items`` ShareGPT conversations (multi-turn: the history is the prompt, at most
``--max-prompt-tokens``; the reference reply, cut to ``--max-response-tokens``, is the response) for every objective
and both ways: corrections (SFT), ratings alternately up and down (KTO), pairs preferring each reply to the next
conversation's (DPO). Their prompts are recorded by the engine as serving records them (the default record dtype).
A mini-batch is trained as the online trainer trains one (``alchemist.training.online``, without its anchors and
evaluation gate): the base model's log-probabilities once (KTO and DPO), then ``epochs`` x (KTO's reference point
under the adapter, the samples' forward and backward, the optimizer's update), with ``OnlineConfig``'s batch
grouping, learning rate and objective weights. Both passes without gradient replay from the records too, or are
recomputed, with the samples (``alchemist.training.logp_passes``); the records are the base model's (version 0),
the case where its reference pass replays: under a trained adapter's records it is recomputed either way. Replay and
recompute alternate (``interleaved_medians``): medians of ``--repeats`` after a warm-up. An item is one feedback
entry (a correction, a rating, a pair); a DPO pair is two sample passes.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time

from alchemist.bench.report import interleaved_medians, print_rows
from alchemist.bench.sharegpt import sample_requests
from alchemist.config import EngineConfig, OnlineConfig, RecordConfig
from alchemist.engine import LLMEngine, SamplingParams
from alchemist.model.loader import load_model
from alchemist.model.lora import LoraAdapter, LoraConfig
from alchemist.training.feedback_batch import FeedbackBatch, Item
from alchemist.training.slices import run_to_end
from alchemist.training.trainer import Trainer

OBJECTIVES = ("sft", "kto", "dpo")
GOAL = 1.3  # replay over recompute, KTO and DPO (issue 24)


def objective_items(objective: str, prompts: list[list[int]], replies: list[list[int]]) -> list[Item]:
    n = len(prompts)
    if objective == "sft":
        return [Item("sft", p, r, f"tp-{i}") for i, (p, r) in enumerate(zip(prompts, replies, strict=True))]
    if objective == "kto":
        return [Item("kto", p, r, f"tp-{i}", desirable=i % 2 == 0)
                for i, (p, r) in enumerate(zip(prompts, replies, strict=True))]  # fmt: skip
    return [Item("dpo", p, r, f"tp-{i}", rejected_ids=replies[(i + 1) % n])
            for i, (p, r) in enumerate(zip(prompts, replies, strict=True))]  # fmt: skip


class MiniBatch:
    """One objective's mini-batch, trained by a ``Trainer`` that replays (or never does), timed by phase."""

    def __init__(self, model, adapter, store, config: OnlineConfig, items: list[Item], replay: bool) -> None:
        self.model, self.adapter, self.items, self.config = model, adapter, items, config
        # Records stay usable however many timed steps the adapter took: the path's cost, not its staleness, is
        # measured.
        trainer = dataclasses.replace(config.trainer, max_staleness=10**9, replay=replay)
        self.trainer = Trainer(model, adapter, store, trainer)
        self.weights = config.objectives
        self.reference_s: list[float] = []  # the base model's pass, per mini-batch
        self.kl_s: list[float] = []  # KTO's reference point under the adapter (a pass without gradient), per epoch
        self.passes = 0

    def __call__(self) -> None:
        batch = FeedbackBatch(self.items, self.weights, self.config.trainer.group_size)
        t0 = time.perf_counter()
        if batch.kto or batch.dpo:
            run_to_end(batch.references_slices(self.trainer))
        self.reference_s.append(time.perf_counter() - t0)
        for _ in range(self.config.stopping.epochs):
            t0 = time.perf_counter()
            samples, scales = run_to_end(batch.samples_slices(self.trainer))
            self.kl_s.append(time.perf_counter() - t0)
            results = run_to_end(self.trainer.step_slices(samples, scales)).passes
            replayed, replay = sum(r for _, r in results), self.trainer.config.replay
            if replayed != (len(results) if replay else 0):  # the other path timed: no number at all rather
                raise RuntimeError(f"{replayed} of {len(results)} samples replayed (replay={replay})")
            self.passes = len(results)
        s = self.trainer.stats
        if (s.reference_recomputed + s.kl_recomputed if replay else s.reference_replayed + s.kl_replayed):
            raise RuntimeError(f"passes without gradient took the other path (replay={replay}): {s}")


def record_prompts(engine: LLMEngine, prompts: list[list[int]]) -> None:
    """Serving's records of the prompts (ids ``tp-<i>``): a one-token request each, recorded."""
    params = SamplingParams(max_tokens=1, temperature=0.0, record=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"tp-{i}", prompt, params)
    done = 0
    while done < len(prompts):
        done += sum(o.finished for o in engine.step())


def throughput(args: argparse.Namespace, config: OnlineConfig) -> list[dict]:
    loaded = load_model(args.model, dtype=args.dtype, device=args.device)
    tok, model = loaded.tokenizer, loaded.model
    engine = LLMEngine(model, tok, EngineConfig(compile_decode=False), RecordConfig())
    samples = sample_requests(args.throughput_items, seed=args.seed, mode="multi_turn", tokenizer=tok,
                              max_prompt_tokens=args.max_prompt_tokens)  # fmt: skip
    prompts = [tok.apply_chat_template(s.messages) for s in samples]
    replies = [tok.encode_reply(s.reply)[: args.max_response_tokens] for s in samples]
    record_prompts(engine, prompts)
    adapter = LoraAdapter(model.config, LoraConfig(r=config.adapter.lora_r, alpha=config.adapter.lora_alpha),
                          device=model.device, seed=config.adapter.seed)  # fmt: skip
    shape = {"items": len(prompts), "prompt_tokens": round(statistics.mean(map(len, prompts))),
             "response_tokens": round(statistics.mean(map(len, replies)))}  # fmt: skip
    rows = []
    for objective in OBJECTIVES:
        items = objective_items(objective, prompts, replies)
        batches = {mode: MiniBatch(model, adapter, engine.store, config, items, mode == "replay")
                   for mode in ("replay", "recompute")}  # fmt: skip
        times = interleaved_medians(batches, args.repeats, warmup=1)
        n = len(items)
        ratio = times["recompute"] / times["replay"]
        rows.append({
            "part": "throughput", "objective": objective, **shape, "passes": batches["replay"].passes,
            "epochs": config.stopping.epochs, "replay_s": round(times["replay"], 3),
            "recompute_s": round(times["recompute"], 3),
            # the passes without gradient, replayed and recomputed: the base model's (once a batch), KTO's z0 (a step)
            "reference_s": round(statistics.median(batches["replay"].reference_s), 3),
            "reference_recompute_s": round(statistics.median(batches["recompute"].reference_s), 3),
            "kl_s": round(statistics.median(batches["replay"].kl_s), 3),
            "kl_recompute_s": round(statistics.median(batches["recompute"].kl_s), 3),
            "replay_items_s": round(n / times["replay"], 2), "recompute_items_s": round(n / times["recompute"], 2),
            "ratio": round(ratio, 2), "goal": f">= {GOAL}" if objective != "sft" else None,
            "met": ratio >= GOAL if objective != "sft" else None,
        })  # fmt: skip
        print_rows(rows[-1:], True, sys.stderr)
    return rows
