"""Teaching facts vs forgetting, offline: the e2e test's loop (tests/server/test_online.py) without the server.

    python docs/profiles/forgetting.py --lr 2e-3 --rounds 5 --anchors 0             # SFT alone
    python docs/profiles/forgetting.py --lr 2e-3 --rounds 7 --anchors 16 --anchor-weight 3

SmolLM2-135M-Instruct in fp32, a fresh LoRA (r=16, alpha=32, all seven projections). Each round is one optimizer
step (the shipped ``Trainer``, AdamW, clip 1.0) on the ten invented facts' corrections, plus (``--anchors`` N) the
KL to the base model on N anchors: the base model's greedy 48-token answers to ShareGPT first-turn questions
(seed 11, none of the held-out ones), with top-k targets from ``references_slices``, weighted ``anchor_weight / N``.
After each round: facts recalled by greedy answers (24 tokens) and the perplexity rise of the held-out ShareGPT
replies the e2e test measures; at the end, how much of the rise sits on the 5% of tokens that rose most.
Recompute path only (replay gives the same gradients: tests/training/test_anchors.py).
"""

from __future__ import annotations

import argparse
import json
import math

import torch

from alchemist.bench.sharegpt import sample_requests
from alchemist.model.attention import AttentionMetadata
from alchemist.model.loader import load_model
from alchemist.model.lora import LoraAdapter
from alchemist.training.anchors import references_slices
from alchemist.training.slices import run_to_end
from alchemist.training.trainer import Sample, Trainer, TrainerConfig
from tests.server.test_online import FACTS, held_out_nll, held_out_replies


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--anchors", type=int, default=16)
    ap.add_argument("--anchor-weight", type=float, default=3.0)
    ap.add_argument("--top-k", type=int, default=32)
    args = ap.parse_args()
    torch.manual_seed(0)
    loaded = load_model(None, dtype="float32", device="cpu")
    model, tok = loaded.model, loaded.tokenizer

    def greedy(prompt: list[int], adapter, max_tokens: int) -> list[int]:
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(max_tokens):
                t = torch.tensor(ids)
                nxt = int(
                    model.logits(
                        model(t, torch.arange(len(t)), AttentionMetadata.single(len(t)), adapter=adapter)[-1:]
                    ).argmax()
                )
                ids.append(nxt)
                if nxt == tok.end_of_turn_token_id:
                    break
        return ids[len(prompt) :]

    facts = [
        Sample(tok.user_prompt(q), tok.encode_reply(fix)) for q, fix, _ in FACTS
    ]
    held_prompts = {tuple(tok.apply_chat_template(s.messages)) for s in held_out_replies(tok)}
    anchors = []
    if args.anchors:
        for s in sample_requests(args.anchors + 12, seed=11, mode="first_turn", tokenizer=tok, max_prompt_tokens=96):
            prompt = tok.apply_chat_template(s.messages)
            if len(anchors) < args.anchors and tuple(prompt) not in held_prompts:
                response = greedy(prompt, None, 48)
                (targets,) = run_to_end(references_slices(model, [(prompt, response)], args.top_k))
                anchors.append(Sample(prompt, response, targets=targets))
    adapter = LoraAdapter(model.config, seed=0)
    trainer = Trainer(model, adapter, None, TrainerConfig(lr=args.lr))
    base = held_out_nll(model, tok, None)
    for round_ in range(1, args.rounds + 1):
        for sample in facts:
            run_to_end(trainer.backward_slices([sample], [1.0 / len(facts)]))
        for sample in anchors:
            run_to_end(trainer.backward_slices([sample], [args.anchor_weight / len(anchors)]))
        trainer.update()
        answers = [tok.decode(greedy(s.prompt_ids, adapter, 24)) for s in facts]
        recalled = sum(key in a.lower() for a, (_, _, key) in zip(answers, FACTS, strict=True))
        taught = held_out_nll(model, tok, adapter)
        rise = math.exp(taught.mean() - base.mean()) - 1
        print(
            json.dumps({**vars(args), "round": round_, "recalled": recalled, "perplexity_rise": round(rise, 4)}),
            flush=True,
        )
    rises = (taught - base).sort(descending=True).values
    top = rises[: len(rises) // 20].sum() / rises.sum()
    print(f"share of the last round's rise (in NLL) on the 5% of held-out tokens that rose most: {top:.2f}")


if __name__ == "__main__":
    main()
