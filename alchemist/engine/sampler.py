"""Picks the next token of each sampling row: greedy, or temperature with top-k / top-p, seeded per request.

Rows are processed together where it matters (argmax, temperature, the top-k/top-p masks, log-softmax); only
the random draw is per row, because each request owns a ``torch.Generator``: a seeded request then draws the same
numbers whatever else is in the batch. The draw is the inverse CDF: one uniform number per row, found in the
row's cumulative probabilities (``searchsorted``). The exponential race (``argmax(p / E)``, ``E ~ Exp(1)``) it
replaced drew a number per vocabulary entry and made a sampled decode step a third slower than a greedy one
(docs/benchmarks.md, "Sampling a token").

Greedy rows take ``argmax`` of the raw logits, bit for bit. Logprobs are of the model's own distribution
(log-softmax of the raw logits, before temperature and filtering), as vLLM reports them by default.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from alchemist.engine.sequence import SamplingParams, TokenLogprobs


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


class Sampler:
    def __call__(
        self, logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
    ) -> SamplerOutput:
        """logits: (N, vocab), one row per request that samples this step, in the order of ``params``."""
        logits = logits.float()
        tokens = logits.argmax(dim=-1)  # (N,) the greedy answer; random rows are overwritten below
        random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        if random_rows:
            tokens[random_rows] = self._sample(
                logits[random_rows], [params[i] for i in random_rows], [generators[i] for i in random_rows]
            )
        token_list = tokens.tolist()
        return SamplerOutput(token_list, self._logprobs(logits, params, token_list))

    def _sample(
        self, logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
    ) -> torch.Tensor:
        """(R, vocab) logits of random rows -> (R,) sampled ids."""
        device = logits.device
        temperature = torch.tensor([p.temperature for p in params], device=device)
        logits = logits / temperature[:, None]  # a new tensor: the steps below work in place
        if any(p.top_k for p in params) or any(p.top_p < 1 for p in params):
            logits = _filter_top_k_top_p(logits, params)
        # exp(l - max), summed, in place (a new vocabulary-wide tensor per op doubled the draw's time): softmax's
        # normalizing division is folded into u x total below.
        cumulative = logits.sub_(logits.amax(dim=-1, keepdim=True)).exp_()
        torch.cumsum(cumulative, dim=-1, out=cumulative)
        assert all(g is not None for g in generators), "a sampling request always has a generator"
        uniform = torch.cat([torch.rand(1, generator=g, device=device) for g in generators])
        # The first token whose cumulative probability exceeds u x total: never one of zero probability (its
        # cumulative equals the one before), and u < 1 keeps it in the vocabulary.
        return torch.searchsorted(cumulative, (uniform * cumulative[:, -1])[:, None], right=True).squeeze(1)

    def _logprobs(
        self, logits: torch.Tensor, params: list[SamplingParams], tokens: list[int]
    ) -> list[TokenLogprobs | None]:
        rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        result: list[TokenLogprobs | None] = [None] * len(params)
        if not rows:
            return result
        logp = torch.log_softmax(logits[rows], dim=-1)
        chosen = logp.gather(1, torch.tensor([[tokens[i]] for i in rows], device=logp.device)).squeeze(1).tolist()
        k = max(params[i].logprobs or 0 for i in rows)
        top_vals, top_ids = logp.topk(k, dim=-1) if k else (logp[:, :0], logp[:, :0].long())
        top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
        for j, i in enumerate(rows):
            n = params[i].logprobs or 0
            result[i] = TokenLogprobs(tokens[i], chosen[j], list(zip(top_ids[j][:n], top_vals[j][:n], strict=True)))
        return result


def _filter_top_k_top_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Sets to -inf every logit outside each row's top-k and top-p (nucleus) sets; (R, vocab) -> (R, vocab)."""
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=logits.device)
    top_p = torch.tensor([p.top_p for p in params], device=logits.device)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    drop = ranks >= top_k[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    # Keep a token while the mass before it is below top_p; the most likely token always survives (a top_p under
    # float32's range is 0 here, and the mass before the first token, 0, would not be below it).
    mass_before = probs.cumsum(dim=-1) - probs
    # Rows with top_p == 1 skip this: fp32 cumsum can reach 1.0 early and would drop tokens it should keep.
    drop |= (mass_before >= top_p[:, None]) & (top_p[:, None] < 1) & (ranks > 0)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(1, order, sorted_logits)
