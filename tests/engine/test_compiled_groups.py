"""Decode steps of several adapters through the compiled layer (``CompiledDecode.forward`` with ``GroupedRows``): the
same answers as the eager engine's, on a tiny random model in fp32, and one compile for steps of any composition."""

from __future__ import annotations

import pytest
from torch._dynamo.utils import counters

from alchemist.engine import SamplingParams
from alchemist.engine.sequence import BASE
from tests.engine.helpers import random_adapter, random_prompts, run_to_end
from tests.engine.test_multi_adapter import WITH_LOGPROBS, answer, assert_same_answer

pytestmark = pytest.mark.slow  # scheduled first (tests/conftest.py)


def test_decodes_of_several_adapters_run_compiled_as_eager(make_engine, tiny_model):
    adapters = {f"team-{i}": random_adapter(tiny_model, 80 + i) for i in range(4)}
    names = [*adapters, BASE, "team-0", "team-2", "team-1", "team-0"]
    prompts = random_prompts([5 + 3 * i for i in range(len(names))], seed=81)
    answers = []
    for setting in (False, True):
        engine = make_engine(compile_decode=setting, max_num_batched_tokens=128)
        for name, adapter in adapters.items():
            engine.set_adapter(adapter, 1, name=name)
        warm = counters["stats"]["unique_graphs"]
        for i, (name, prompt) in enumerate(zip(names, prompts, strict=True)):
            engine.add_request(str(i), prompt, WITH_LOGPROBS, adapter_name=name)
        outs = run_to_end(engine)
        # requests of fewer adapters: steps of other compositions and batch sizes, no new graph
        engine.generate(prompts[:3], SamplingParams(max_tokens=4, temperature=0), adapter_name="team-3")
        for i, name in enumerate(["team-1", "team-3", "team-1"]):
            engine.add_request(f"late{i}", prompts[i], SamplingParams(max_tokens=5, temperature=0), adapter_name=name)
        run_to_end(engine)
        answers.append({request_id: answer(got) for request_id, got in outs.items()})
        assert engine.runner.num_mixed_steps > 0
    compiled = engine.runner.compiled
    assert compiled.num_grouped_steps >= WITH_LOGPROBS.max_tokens - 1
    assert counters["stats"]["unique_graphs"] - warm <= 1  # the grouped layer's one graph, dynamic in every size
    for request_id, got in answers[1].items():
        assert_same_answer(got, answers[0][request_id], request_id)
