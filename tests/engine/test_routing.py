"""Routing the corrections' ranks (alchemist.engine.router, LoraAdapter.cut): a request like a taught prompt gets
them from its last prompt token on, any other request never; its prompt rows are the same either way."""

from __future__ import annotations

import pytest

from alchemist.engine import SamplingParams
from alchemist.training.rank_split import RankSplit, Scoped
from tests.engine.helpers import greedy_reference, random_adapter, random_prompts, run_to_end

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
EVERY_ROW = 1 << 30  # Scoped: this many leading rows out of the cut ranks' scope, i.e. all


def cut_adapter(model, seed: int, taught: list[list[int]]):
    adapter = random_adapter(model, seed)
    RankSplit(adapter, 4, cut=True)  # 12 corrections' ranks, 4 preference ranks
    adapter.taught = taught
    return adapter


@pytest.mark.parametrize("merge", [True, False])
def test_a_taught_prompt_gets_the_corrections_ranks_from_its_last_token_and_others_never(
    make_engine, tiny_model, merge
):
    taught, other = random_prompts([23, 31], seed=3)
    adapter = cut_adapter(tiny_model, 1, [taught])
    engine = make_engine(merge_adapter=merge)
    engine.set_adapter(adapter, 1)
    engine.add_request("t", taught, GREEDY)
    engine.add_request("o", other, GREEDY)  # in the same steps: rows with and without the cut ranks together
    outs = run_to_end(engine)
    assert [engine.router.routes(p) for p in (taught, other)] == [True, False]

    routed = greedy_reference(tiny_model, taught, 12, [Scoped(adapter, len(taught) - 1), adapter])
    unrouted = greedy_reference(tiny_model, other, 12, [Scoped(adapter, EVERY_ROW)])
    assert outs["t"][-1].output_token_ids == routed
    assert outs["o"][-1].output_token_ids == unrouted
    # the cut and the route matter: all ranks on every row serves other tokens
    assert routed != greedy_reference(tiny_model, taught, 12, [adapter])
    assert unrouted != greedy_reference(tiny_model, other, 12, [adapter])


def test_nothing_taught_serves_the_preference_ranks_alone(make_engine, tiny_model):
    prompt = random_prompts([19], seed=4)[0]
    adapter = cut_adapter(tiny_model, 2, [])
    engine = make_engine()
    engine.set_adapter(adapter, 1)
    engine.add_request("r", prompt, GREEDY)
    assert run_to_end(engine)["r"][-1].output_token_ids == greedy_reference(tiny_model, prompt, 12,
                                                                             [Scoped(adapter, EVERY_ROW)])  # fmt: skip


def test_a_routed_answer_is_never_a_later_prompt_cached_prefix(make_engine, tiny_model):
    """A routed request's keys/values from its last prompt token on hold the cut ranks: a later prompt that
    continues it (the next turn) computes those rows again, without them."""
    taught = random_prompts([40], seed=5)[0]
    adapter = cut_adapter(tiny_model, 3, [taught])
    engine = make_engine(block_size=8)
    engine.set_adapter(adapter, 1)
    engine.add_request("t", taught, GREEDY)
    answer = run_to_end(engine)["t"][-1].output_token_ids
    follow = taught + answer + random_prompts([9], seed=6)[0]
    engine.add_request("f", follow, GREEDY)
    got = run_to_end(engine)["f"][-1].output_token_ids
    # the follow-up is routed too (it holds the taught prompt): its own last prompt token on gets the cut ranks
    assert got == greedy_reference(tiny_model, follow, 12, [Scoped(adapter, len(follow) - 1), adapter])
