"""``min_tokens``: no EOS, stop token or stop string ends a request before it has that many output tokens (the tiny
random model, greedy, so the tokens are those of an ``ignore_eos`` run up to where it stops)."""

from __future__ import annotations

import pytest

from alchemist.engine import SamplingParams
from tests.engine.helpers import random_prompts

MAX_TOKENS = 24


def greedy(**fields) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0, **fields)


@pytest.fixture
def run(make_engine):
    """(run(eos_id=None, **params) -> RequestOutput, the ignore_eos tokens, a token id that recurs in them)."""
    prompt = random_prompts([12], seed=3)[0]  # its greedy run repeats a token at 0, 7 and 17 (seed picked for it)
    tokens = make_engine().generate([prompt], greedy(ignore_eos=True))[0].output_token_ids
    stop_id = tokens[0]
    assert [i for i, t in enumerate(tokens) if t == stop_id] == [0, 7, 17]

    def run(eos_id: int | None = None, **fields):
        engine = make_engine(eos_id=eos_id) if eos_id is not None else make_engine()
        return engine.generate([prompt], greedy(**fields))[0]

    return run, tokens, stop_id


@pytest.mark.parametrize(
    "min_tokens, num_tokens, reason",
    [
        (0, 1, "stop"),  # the first token is EOS
        (1, 1, "stop"),  # the EOS is the min_tokens-th token (the token just sampled counts): it may stop
        (2, 8, "stop"),  # held: the next EOS, the 8th token, stops
        (9, 18, "stop"),
        (19, MAX_TOKENS, "length"),  # no EOS after the 19th token
        (MAX_TOKENS, MAX_TOKENS, "length"),  # a benchmark's forced length: exactly max_tokens
    ],
)
def test_min_tokens_keeps_eos_from_finishing_early(run, min_tokens, num_tokens, reason):
    run, tokens, stop_id = run
    out = run(eos_id=stop_id, min_tokens=min_tokens)
    assert out.output_token_ids == tokens[:num_tokens] and out.finish_reason == reason


def test_min_tokens_holds_stop_token_ids_too(run):
    run, tokens, stop_id = run
    out = run(stop_token_ids=[stop_id], ignore_eos=True, min_tokens=2)
    assert out.output_token_ids == tokens[:8] and out.finish_reason == "stop"


def test_min_tokens_holds_stop_strings(run, make_engine):
    run, tokens, stop_id = run
    full = make_engine().tokenizer.decode(tokens)  # one character per token (no EOS among them)
    stop = make_engine().tokenizer.decode([stop_id])
    assert len(full) == MAX_TOKENS and run(ignore_eos=True, stop=[stop]).text == ""
    out = run(ignore_eos=True, stop=[stop], min_tokens=2)
    assert out.text == full[:7] and out.finish_reason == "stop"


def test_min_tokens_is_validated():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=-1)
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=1.5)
    with pytest.raises(ValueError, match="min_tokens=5 must be <= max_tokens=4"):
        SamplingParams(max_tokens=4, min_tokens=5)
    assert SamplingParams(min_tokens=100).min_tokens == 100  # no max_tokens: the context bounds it
