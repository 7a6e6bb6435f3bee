"""Profile (not a test): can a correction be learned by ranks that act only from the last prompt token on?

    PYTHONPATH=. python docs/profiles/live_rows_correction.py [--steps 8] [--lr 2e-3]

The question behind it (docs/benchmarks.md, "Learning a correction with the defaults": a router would keep taught
corrections away from unrelated requests, but a routed-out request's record would not be the taught adapter's
forward, so a correction to it could not be replayed). If the correction ranks acted only on the rows at positions
P-1 and later (the last prompt token and the answer: exactly the replay walk's live rows, which training recomputes
anyway), every prompt row 0..P-2 would be the same whether a request was routed in or out: its record and its KV
cache would serve both, and routing would cost replay nothing. That is Activated LoRA's cut (Greenewald et al.,
2025: the adapter applies from an invocation point on, so the base model's KV cache of the prompt is reused).

It is worth building only if ranks acting from P-1 on learn a fact about as well as ranks acting on every row. So,
on SmolLM2 (fp32), the ten invented facts of ``alchemist.bench.facts`` taught as ``bench learn`` teaches them: one
batch of the ten corrections, AdamW at the default learning rate, up to ``--steps`` steps until each correction's
loss is under 0.2 (``OnlineConfig.target_loss``); the facts still wrong get a second correction and the same again.
Two adapters from the same initialization: ``all`` (the delta on every row, as now) and ``live`` (the delta on rows
P-1.. only, in training and in the greedy answers). Reported: facts known after one and two corrections, steps,
hand-written paraphrases of the ten answered, after the second round. Plain SFT: no protected directions, anchors or
rehearsal (the comparison is of the two cuts, not of the defaults). Deterministic.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from alchemist.bench.facts import FACT_PARAPHRASES as PARAPHRASES
from alchemist.bench.facts import FACTS
from alchemist.model.loader import load_model
from alchemist.model.lora import LoraAdapter, LoraConfig
from alchemist.training.recompute import recompute_losses, responses_hidden_slices
from alchemist.training.slices import run_to_end


class FromLastPromptToken:
    """The adapter's delta on the rows at positions P-1 and later of each (prompt, response) laid end to end (as
    ``alchemist.training.recompute`` lays them), zero on the prompt's other rows."""

    def __init__(self, adapter: LoraAdapter, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.adapter = adapter
        masks = [torch.cat([torch.zeros(len(p) - 1), torch.ones(len(r))]) for p, r in pairs]
        self.mask = torch.cat(masks)[:, None]

    def delta(self, layer: int, name: str, x: torch.Tensor) -> torch.Tensor | None:
        d = self.adapter.delta(layer, name, x)
        return None if d is None else d * self.mask.to(d.dtype)


def view(adapter: LoraAdapter, cut: str, pairs):
    return adapter if cut == "all" else FromLastPromptToken(adapter, pairs)


def greedy(model, tokenizer, adapter, cut: str, prompt: list[int], max_tokens: int = 24) -> str:
    out: list[int] = []
    stop = set(tokenizer.eos_token_ids)
    p = torch.tensor(prompt)
    with torch.no_grad():
        for _ in range(max_tokens):
            pairs = [(p, torch.tensor(out + [0]))]
            hidden = run_to_end(responses_hidden_slices(model, view(adapter, cut, pairs), pairs))[0]
            token = int(model.logits(hidden[-1:]).argmax(-1))
            if token in stop:
                break
            out.append(token)
    return tokenizer.decode(out)


def teach(model, adapter, cut: str, samples, steps: int, lr: float, optimizer) -> tuple[int, list[float]]:
    losses: list[float] = []
    for step in range(steps):
        pairs = [(p, r) for p, r, _ in samples]
        values = recompute_losses(model, view(adapter, cut, pairs), samples)
        losses = [float(v) for v in values]
        if max(losses) < 0.2:
            return step, losses
        optimizer.zero_grad(set_to_none=True)
        torch.stack(values).mean().backward()
        torch.nn.utils.clip_grad_norm_(adapter.parameters(), 1.0)
        optimizer.step()
    return steps, losses


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--r", type=int, default=16)
    args = ap.parse_args()
    torch.manual_seed(0)
    loaded = load_model(None, dtype="float32", device="cpu")
    model, tok = loaded.model, loaded.tokenizer
    for cut in ("all", "live"):
        t0 = time.perf_counter()
        adapter = LoraAdapter(model.config, LoraConfig(r=args.r, alpha=2.0 * args.r), seed=0)
        optimizer = torch.optim.AdamW(adapter.parameters(), lr=args.lr, betas=(0.9, 0.999), weight_decay=0.0)
        known: list[int] = []
        steps: list[int] = []
        wrong = list(range(len(FACTS)))
        for _ in range(2):
            samples = [(torch.tensor(tok.user_prompt(FACTS[i][0])), torch.tensor(tok.encode_reply(FACTS[i][1])), None)
                       for i in wrong]  # fmt: skip
            n, _ = teach(model, adapter, cut, samples, args.steps, args.lr, optimizer)
            steps.append(n)
            answers = [greedy(model, tok, adapter, cut, tok.user_prompt(q)) for q, _, _ in FACTS]
            right = [key in a.lower() for a, (_, _, key) in zip(answers, FACTS, strict=True)]
            known.append(sum(right))
            wrong = [i for i, ok in enumerate(right) if not ok]
            if not wrong:
                break
        para = [greedy(model, tok, adapter, cut, tok.user_prompt(q)) for q in PARAPHRASES]
        para_right = sum(key in a.lower() for a, (_, _, key) in zip(para, FACTS, strict=True))
        print(json.dumps({"cut": cut, "known_after": known, "steps": steps, "paraphrases": para_right,
                          "paraphrase_answers": para, "s": round(time.perf_counter() - t0, 1)}), flush=True)


if __name__ == "__main__":
    main()
