"""Profile (not a test): how close SmolLM2's greedy answers to `bench learn`'s 30 unrelated questions come to a
tie, i.e. how small a change of the model flips them.

    OMP_NUM_THREADS=1 PYTHONPATH=. python docs/profiles/greedy_margins.py [--dtype float32] [--tokens 32]

Per question, the greedy answer of the base model (a plain forward per token, no engine), and at each position the
margin between the chosen token's log-probability and the runner-up's. An answer stays unchanged under a change of
the model only if no position's margin is crossed (before the first change, every later position depends on it):
the smallest margin of each answer is printed, and how many answers have one under 0.05, 0.1, 0.2, 0.5, 1 nats.
"""

from __future__ import annotations

import argparse

import torch

from alchemist.bench.learn import UNRELATED_TOKENS, sharegpt_questions
from alchemist.model.attention import AttentionMetadata, Segment
from alchemist.model.loader import load_model


@torch.no_grad()
def margins(model, prompt: list[int], tokens: int, stop: set[int]) -> list[float]:
    ids, out = list(prompt), []
    for _ in range(tokens):
        x = torch.tensor(ids)
        meta = AttentionMetadata([Segment(slot=0, start=0, length=len(ids))])
        hidden = model.forward(x, torch.arange(len(ids)), meta)[-1:]
        logp = torch.log_softmax(model.logits(hidden).float(), dim=-1)[0]
        top = logp.topk(2)
        out.append((top.values[0] - top.values[1]).item())
        ids.append(top.indices[0].item())
        if ids[-1] in stop:  # the answer ended
            break
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--tokens", type=int, default=UNRELATED_TOKENS)
    args = ap.parse_args()
    loaded = load_model(None, dtype=args.dtype, device="cpu")
    tok, model = loaded.tokenizer, loaded.model
    questions = sharegpt_questions(tok, 30, seed=23, exclude=set())  # bench learn's unrelated questions
    smallest = []
    for q in questions:
        m = margins(model, tok.user_prompt(q), args.tokens, set(tok.eos_token_ids))
        smallest.append(min(m))
        print(f"{min(m):7.3f} at {m.index(min(m)):2d}  {q[:60]!r}")
    for bound in (0.05, 0.1, 0.2, 0.5, 1.0):
        print(f"answers with a margin under {bound:g} nats: {sum(s < bound for s in smallest)} of {len(smallest)}")


if __name__ == "__main__":
    main()
