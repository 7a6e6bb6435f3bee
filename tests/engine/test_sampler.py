"""The sampler: greedy is argmax bit for bit, filters keep the right sets, draws follow p and the seed alone."""

from __future__ import annotations

import math

import torch

from alchemist.engine.sampler import Sampler
from alchemist.engine.sequence import SamplingParams


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_greedy_rows_are_argmax_next_to_random_rows():
    logits = torch.randn(6, 1000, generator=generator(0))
    params = [SamplingParams(temperature=0 if i % 2 == 0 else 1.0) for i in range(6)]
    gens = [None if p.is_greedy else generator(i) for i, p in enumerate(params)]
    out = Sampler()(logits, params, gens)
    expected = logits.argmax(-1).tolist()
    assert [out.token_ids[i] for i in (0, 2, 4)] == [expected[i] for i in (0, 2, 4)]


def test_top_k_one_and_tiny_top_p_are_greedy():
    logits = torch.randn(5, 500, generator=generator(1))
    params = [SamplingParams(top_k=1), SamplingParams(top_p=1e-6), SamplingParams(top_k=1, top_p=0.5)]
    params.append(SamplingParams(temperature=5.0, top_k=1))
    params.append(SamplingParams(temperature=0.26, top_p=1.02e-79))  # 0 in float32: the top token still survives
    out = Sampler()(logits, params, [generator(i) for i in range(5)])
    assert out.token_ids == logits.argmax(-1).tolist()


def test_a_temperature_under_float32s_reach_is_greedy():
    """Logits divided by 1e-300 (0 in float32) or 1e-7 overflow: such a request decodes greedily, as vLLM's does
    under 1e-5, never a token past the vocabulary."""
    logits = torch.randn(3, 500, generator=generator(2)) * 5
    params = [SamplingParams(temperature=t, seed=1) for t in (1e-300, 1e-7, 9e-6)]
    assert all(p.is_greedy for p in params) and not SamplingParams(temperature=1e-5).is_greedy
    out = Sampler()(logits, params, [None] * 3)
    assert out.token_ids == logits.argmax(-1).tolist()


def test_draws_follow_the_filtered_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    sampler = Sampler()
    cases = [
        (SamplingParams(temperature=1.0), torch.softmax(logits[0], -1)),
        (SamplingParams(temperature=0.5, top_k=2), torch.softmax(logits[0, :2] / 0.5, -1)),
        # p = .563, .207, .126, .076, .028. top_p=0.8: the mass before the third (.770) is under 0.8, so it is
        # kept; before the fourth (.896) it is not.
        (SamplingParams(top_p=0.8), torch.softmax(logits[0, :3], -1)),
        (SamplingParams(top_p=0.7), torch.softmax(logits[0, :2], -1)),
    ]
    n = 4000
    for params, expected in cases:
        g = generator(7)
        counts = torch.zeros(5)
        for _ in range(n):
            counts[sampler(logits, [params], [g]).token_ids[0]] += 1
        freq = counts[: len(expected)] / n
        assert counts[len(expected) :].sum() == 0, params
        # 5 standard deviations of a binomial frequency: fails by chance about once in 10^6 runs.
        tolerance = 5 * torch.sqrt(expected * (1 - expected) / n)
        assert ((freq - expected).abs() <= tolerance).all(), (params, freq, expected)


def test_same_seed_same_draws_whatever_the_batch():
    logits = torch.randn(5, 300, generator=generator(2))
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=3)
    g_alone, g_batched = generator(3), generator(3)
    others = [SamplingParams(temperature=0.7), SamplingParams(temperature=0.7, seed=1)]
    batch_params = [*others, params, SamplingParams(temperature=0), SamplingParams(top_k=5)]
    gens = [generator(10), generator(11), g_batched, None, generator(12)]
    for _ in range(20):  # the generator's state advances the same way in both
        alone = Sampler()(logits[2:3], [params], [g_alone]).token_ids[0]
        assert Sampler()(logits, batch_params, gens).token_ids[2] == alone


def test_logprobs_are_the_models_log_softmax():
    logits = torch.randn(3, 50, generator=generator(4))
    params = [SamplingParams(temperature=0, logprobs=2), SamplingParams(temperature=0), SamplingParams(logprobs=0)]
    out = Sampler()(logits, params, [None, None, generator(5)])
    logp = torch.log_softmax(logits, -1)
    first = out.logprobs[0]
    assert first is not None and first.token_id == out.token_ids[0]
    assert math.isclose(first.logprob, logp[0].max().item(), rel_tol=1e-6)
    top = logp[0].topk(2)
    assert [t for t, _ in first.top] == top.indices.tolist()
    assert out.logprobs[1] is None
    third = out.logprobs[2]
    assert third is not None and third.top == []
    assert math.isclose(third.logprob, logp[2, out.token_ids[2]].item(), rel_tol=1e-6)
