"""Profile (not a test): how fast corrections are learned, and what else moves, in process (no HTTP).

    OMP_NUM_THREADS=2 PYTHONPATH=. python docs/profiles/learn_defaults.py [--set lr=1e-3 --set epochs=8 ...]
        [--others 16] [--rounds 2] [--dtype auto]

The server's parts as `alchemist serve` builds them (the model in ``--dtype``, its engine with the default
record policy, the feedback log, the ``OnlineTrainer`` with ``OnlineConfig()`` plus ``--set`` overrides, eager
decoding to save the compile), driven by hand: each round asks the ten invented facts of tests/server/test_online.py
that are not answered right yet (greedy, 24 tokens, recorded), beside ``--others`` ShareGPT questions nobody gives
feedback on (served completions: the anchors), corrects the wrong answers in the log, and trains until the queue is
empty. Prints per round the facts held, the steps trained and their time; at the end the held-out perplexity rise
(the e2e test's 12 ShareGPT replies, fp32 model, vs the base model) and how many of 30 other ShareGPT prompts keep
their greedy 32-token answer exactly.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path

from alchemist.bench.learn import online_config
from alchemist.bench.sharegpt import sample_requests
from alchemist.config import EngineConfig, RecordConfig
from alchemist.engine import LLMEngine, SamplingParams
from alchemist.feedback.sqlite_log import SQLiteFeedbackLog
from alchemist.model.loader import load_model
from alchemist.training.anchors import Anchor
from alchemist.training.checkpoint import AdapterCheckpoints
from alchemist.training.online import OnlineTrainer
from tests.server.test_online import FACTS, held_out_nll, held_out_replies


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--set", action="append", default=[], help="OnlineConfig field=value")
    ap.add_argument("--others", type=int, default=16, help="ShareGPT questions asked beside each round's facts")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    overrides = args.set
    config = online_config(args.set)  # the bench's parsing and checks
    config.queue.max_wait_s = 0.0
    loaded = load_model(None, dtype=args.dtype, device="cpu")
    fp32 = load_model(None, dtype="float32", device="cpu")
    tok = loaded.tokenizer
    engine = LLMEngine(loaded.model, tok, EngineConfig(max_num_seqs=32, compile_decode=False), RecordConfig())
    work = Path(tempfile.mkdtemp())
    log = SQLiteFeedbackLog(work / "feedback.sqlite")
    trainer = OnlineTrainer.from_config(engine.model, engine.tokenizer, engine, engine.store, log,
                                        AdapterCheckpoints(work / "adapters", 8), config)

    held = {s.messages[0]["content"] for s in held_out_replies(tok)}
    pool = [s.messages[0]["content"] for s in sample_requests(80, seed=23, mode="first_turn", tokenizer=tok,
                                                                max_prompt_tokens=96)]  # fmt: skip
    unrelated = [q for q in pool if q not in held][:30]
    traffic = [s.messages[0]["content"] for s in sample_requests(args.rounds * args.others + 40, seed=11,
                                                                   mode="first_turn", tokenizer=tok,
                                                                   max_prompt_tokens=96)]  # fmt: skip
    traffic = [q for q in traffic if q not in held and q not in unrelated]
    counter = iter(range(10**9))

    def ask(questions: list[str], max_tokens: int, offer: bool) -> list[tuple[str, list[int], list[int], str]]:
        prompts = [tok.user_prompt(q) for q in questions]
        ids = [f"r{next(counter)}" for _ in prompts]
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, record=True)
        for rid, prompt in zip(ids, prompts, strict=True):
            engine.add_request(rid, prompt, params)
        final = {}
        while len(final) < len(ids):
            final.update((o.request_id, o) for o in engine.step() if o.finished)
        out = []
        for rid, prompt in zip(ids, prompts, strict=True):
            o = final[rid]
            if offer:
                trainer.anchors.offer(Anchor(rid, prompt, list(o.output_token_ids)))
            out.append((rid, prompt, list(o.output_token_ids), tok.decode(o.output_token_ids)))
        return out

    before_unrelated = [a[2] for a in ask(unrelated, 32, offer=False)]
    pending = list(range(len(FACTS)))
    corrections = [0] * len(FACTS)
    t_start = time.perf_counter()
    for round_ in range(1, args.rounds + 2):
        others = traffic[(round_ - 1) * args.others : round_ * args.others] if round_ <= args.rounds else []
        answers = ask([FACTS[i][0] for i in pending], 24, offer=False)
        if others:
            ask(others, 24, offer=True)
        right = [i for i, a in zip(pending, answers, strict=True) if FACTS[i][2] in a[3].lower()]
        print(json.dumps({"round": round_ - 1, "facts_held_new": len(right), "pending": len(pending),
                          "answers": [a[3][:60] for a in answers][:3]}), flush=True)  # fmt: skip
        if round_ > args.rounds:
            pending = [i for i in pending if i not in right]
            break
        for i, (rid, prompt, output, _) in zip(pending, answers, strict=True):
            if i in right:
                continue
            corrections[i] += 1
            log.append(response_id=rid, kind="sft", correction=FACTS[i][1], prompt_token_ids=prompt,
                       response_token_ids=tok.encode_reply(FACTS[i][1]), output_token_ids=output,
                       adapter_version=engine.adapter_version, recorded=True)  # fmt: skip
        pending = [i for i in pending if i not in right]
        t0, steps0 = time.perf_counter(), trainer.stats.steps
        while trainer.has_work():
            trainer.run_slice()
            while trainer._job is not None:
                trainer.run_slice()
        engine.step()  # the new adapter is applied when the engine is idle
        train_s = round(time.perf_counter() - t0, 1)
        print(json.dumps({"round": round_, "steps": trainer.stats.steps - steps0, "train_s": train_s,
                          "loss": trainer.stats.last_loss, "anchor_kl": trainer.stats.last_anchor_kl}),
              flush=True)  # fmt: skip
    learned = len(FACTS) - len(pending)
    after_unrelated = [a[2] for a in ask(unrelated, 32, offer=False)]
    unchanged = sum(a == b for a, b in zip(before_unrelated, after_unrelated, strict=True))
    unchanged_16 = sum(a[:16] == b[:16] for a, b in zip(before_unrelated, after_unrelated, strict=True))
    diverge_at = sorted(next(i for i, (x, y) in enumerate(zip(a + [-1], b + [-2], strict=False)) if x != y)
                        for a, b in zip(before_unrelated, after_unrelated, strict=True) if a != b)  # fmt: skip
    adapter = trainer.adapter
    base = held_out_nll(fp32.model, fp32.tokenizer, None).mean()
    taught = held_out_nll(fp32.model, fp32.tokenizer, adapter).mean()
    rise = math.exp(taught - base) - 1
    print(json.dumps({"overrides": overrides, "others": args.others, "learned": learned, "of": len(FACTS),
                      "corrections": corrections, "steps": trainer.stats.steps, "perplexity_rise": round(rise, 4),
                      "unrelated_unchanged": unchanged, "unchanged_first_16": unchanged_16, "diverge_at": diverge_at,
                      "of_unrelated": len(unrelated),
                      "train_total_s": round(trainer.stats.train_s, 1),
                      "wall_s": round(time.perf_counter() - t_start, 1)}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
