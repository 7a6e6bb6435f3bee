"""Profile (not a test): do thumbs and preference pairs move the served model? In process (no HTTP).

    OMP_NUM_THREADS=1 PYTHONPATH=. python docs/profiles/learn_preferences.py --feedback thumbs [--prompts 32]
        [--rounds 2] [--max-tokens 128] [--held-out 16] [--set lr=1e-3 --set epochs=8 ...] [--dtype auto]

The server's parts as `alchemist serve` builds them (the model in ``--dtype``, its engine with the default record
policy, the feedback log, the ``OnlineTrainer`` with ``OnlineConfig()`` plus ``--set`` overrides, eager decoding to
save the compile), driven by hand. The preference shown: shorter answers. Before training and after each round, the
greedy answers (``--max-tokens``) to ``--held-out`` ShareGPT prompts that are never trained on; their median
length is what must fall. Each round samples answers (temperature 1, recorded) to ``--prompts`` new ShareGPT
prompts with the adapter served now, and logs the feedback as the server would:

- ``thumbs``: one answer per prompt, thumbs-up (rating 1, no correction: KTO desirable) for those shorter than the
  round's median length, thumbs-down (KTO undesirable) for the others (the median is often ``--max-tokens``);
- ``reversed``: the same, thumbs the other way round (the length must not fall);
- ``pairs``: two answers per prompt, the shorter preferred (DPO; a tie gives no pair);
- ``none``: no feedback (the length must stay).

Every served completion is offered to the trainer's anchors, as the server does (those with feedback drop out), so
the held-out answers are anchors too. Then it trains until the queue is empty. Prints per round the medians, the
entries, steps and train seconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path

from alchemist.bench.learn import online_config
from alchemist.bench.sharegpt import sample_requests
from alchemist.config import EngineConfig, RecordConfig
from alchemist.engine import LLMEngine, SamplingParams
from alchemist.feedback.log import FeedbackLog
from alchemist.model.loader import load_model
from alchemist.training.anchors import Anchor
from alchemist.training.checkpoint import AdapterCheckpoints
from alchemist.training.online import OnlineTrainer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--feedback", choices=("thumbs", "reversed", "pairs", "none"), default="thumbs")
    ap.add_argument("--prompts", type=int, default=32, help="training prompts per round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--held-out", type=int, default=16)
    ap.add_argument("--set", action="append", default=[], help="OnlineConfig field=value")
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    overrides = args.set
    config = dataclasses.replace(online_config(args.set), max_wait_s=0.0)  # the bench's parsing and checks
    loaded = load_model(None, dtype=args.dtype, device="cpu")
    tok = loaded.tokenizer
    engine = LLMEngine(loaded.model, tok, EngineConfig(max_num_seqs=32, compile_decode=False), RecordConfig())
    work = Path(tempfile.mkdtemp())
    log = FeedbackLog(work / "feedback.sqlite")
    trainer = OnlineTrainer(engine.model, engine.tokenizer, engine, engine.store, log,
                            AdapterCheckpoints(work / "adapters", 8), config)

    held_out, training = prompts(tok, args.held_out, args.rounds * args.prompts)
    counter = iter(range(10**9))

    def serve(questions: list[str], temperature: float, seed: int = 0) -> list[tuple[str, list[int], list[int]]]:
        """(request id, prompt ids, output ids) of each question's answer, offered to the anchors."""
        chats = [tok.user_prompt(q) for q in questions]
        ids = [f"r{next(counter)}" for _ in chats]
        for i, (rid, prompt) in enumerate(zip(ids, chats, strict=True)):
            params = SamplingParams(max_tokens=args.max_tokens, temperature=temperature, seed=seed + i, record=True)
            engine.add_request(rid, prompt, params)
        final = {}
        while len(final) < len(ids):
            final.update((o.request_id, o) for o in engine.step() if o.finished)
        out = [(rid, prompt, list(final[rid].output_token_ids)) for rid, prompt in zip(ids, chats, strict=True)]
        for rid, prompt, output in out:
            trainer.anchors.offer(Anchor(rid, prompt, output))
        return out

    def held_out_median() -> float:
        lengths = sorted(len(o) for _, _, o in serve(held_out, 0.0))
        print(json.dumps({"held_out_lengths": lengths}), flush=True)
        return statistics.median(lengths)

    def append(rid: str, prompt: list[int], output: list[int], **fields) -> None:
        log.append(response_id=rid, prompt_token_ids=prompt, output_token_ids=output,
                   adapter_version=engine.adapter_version, recorded=True, **fields)  # fmt: skip

    before = held_out_median()
    print(json.dumps({"round": 0, "held_out_median": before}), flush=True)
    t_start, entries = time.perf_counter(), 0
    for round_ in range(1, args.rounds + 1):
        questions = training[(round_ - 1) * args.prompts : round_ * args.prompts]
        if args.feedback == "pairs":
            first, second = serve(questions, 1.0, seed=1000 * round_), serve(questions, 1.0, seed=1000 * round_ + 500)
            for a, b in zip(first, second, strict=True):
                if len(a[2]) == len(b[2]):
                    continue
                short, long_ = (a, b) if len(a[2]) < len(b[2]) else (b, a)
                append(short[0], short[1], short[2], kind="preference", preferred_over=long_[0],
                       response_token_ids=short[2], rejected_token_ids=long_[2])  # fmt: skip
                entries += 1
            sampled = [len(o) for _, _, o in first + second]
        else:
            answers = serve(questions, 1.0, seed=1000 * round_)
            sampled = [len(o) for _, _, o in answers]
            split = statistics.median(sampled)
            for rid, prompt, output in answers if args.feedback != "none" else []:
                up = (len(output) < split) == (args.feedback == "thumbs")
                append(rid, prompt, output, kind="sft" if up else "negative", rating=1 if up else -1,
                       response_token_ids=output)  # fmt: skip
                entries += 1
        t0, steps0 = time.perf_counter(), trainer.stats.steps
        while trainer.has_work():
            trainer.run_slice()
            while trainer._job is not None:
                trainer.run_slice()
        engine.step()  # the new adapter is applied when the engine is idle
        train_s = round(time.perf_counter() - t0, 1)
        median = held_out_median()
        print(json.dumps({"round": round_, "entries": entries, "sampled_median": statistics.median(sampled),
                          "steps": trainer.stats.steps - steps0, "train_s": train_s, "loss": trainer.stats.last_loss,
                          "anchor_kl": trainer.stats.last_anchor_kl, "held_out_median": median,
                          "fall": round(1 - median / before, 3)}), flush=True)  # fmt: skip
    print(json.dumps({"feedback": args.feedback, "overrides": overrides, "prompts": args.prompts,
                      "rounds": args.rounds, "entries": entries, "steps": trainer.stats.steps,
                      "held_out_median_before": before, "held_out_median_after": median,
                      "fall": round(1 - median / before, 3), "train_total_s": round(trainer.stats.train_s, 1),
                      "wall_s": round(time.perf_counter() - t_start, 1)}), flush=True)  # fmt: skip


def prompts(tok, held_out: int, training: int) -> tuple[list[str], list[str]]:
    """``held_out`` ShareGPT first-turn questions to measure on, and ``training`` others to give feedback on."""
    pool = sample_requests(held_out + training + 8, seed=31, mode="first_turn", tokenizer=tok, max_prompt_tokens=96)
    questions = list(dict.fromkeys(s.messages[0]["content"] for s in pool))
    return questions[:held_out], questions[held_out : held_out + training]


if __name__ == "__main__":
    main()
