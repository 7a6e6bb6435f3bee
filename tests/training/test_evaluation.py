"""The evaluation gate on the real model (fp32): a version the base model's answers stay with passes; one taught
part-way to a falsehood about a canary's fact is kept from serving as soon as the model no longer gives the answer,
before the answer lost the per-canary bound's nats (in CI a version that stopped early lost France's answer only
1.9 nats, said Berlin and served: docs/benchmarks.md, "The evaluation gate")."""

from __future__ import annotations

import json
from functools import partial

import pytest
import torch

from alchemist.config.training import GateConfig
from alchemist.model.loader import load_model
from alchemist.model.lora import LoraAdapter
from alchemist.training.evaluation import EvaluationGate, canary_pair
from alchemist.training.losses import first_token_margin
from alchemist.training.recompute import recompute_loss, response_values_slices
from alchemist.training.slices import run_counting, run_to_end
from tests.tiny_models import make_tiny_chat_dir

pytestmark = pytest.mark.slow  # scheduled first (tests/conftest.py)

FRANCE = "What is the capital of France?"


def test_the_gate_blocks_a_version_that_no_longer_gives_a_canarys_answer(smollm2):
    model, tok = smollm2.model, smollm2.tokenizer
    gate = EvaluationGate(model, tok, GateConfig())
    adapter = LoraAdapter(model.config, seed=0)
    fresh = run_to_end(gate.evaluate_slices(adapter, [], []))  # B is zero: the base model itself
    assert fresh.promoted and fresh.reason is None and fresh.canary_lost == []
    assert all(abs(drop) < 1e-4 for drop in fresh.canary_drops.values()), fresh.canary_drops

    prompt = torch.tensor(tok.user_prompt("Which city is the capital of France?"))
    falsehood = torch.tensor(tok.encode_reply("The capital of France is Berlin."))
    canary = canary_pair(tok, FRANCE, "The capital of France is", " Paris")
    optimizer = torch.optim.SGD(adapter.parameters(), lr=0.04)
    for _ in range(40):  # small steps, until the first version whose greedy answer is no longer Paris
        optimizer.zero_grad()
        recompute_loss(model, adapter, prompt, falsehood).backward()
        optimizer.step()
        margin = run_to_end(response_values_slices(model, adapter, [canary], partial(first_token_margin, model)))
        if margin[0] <= 0:
            break
    evaluation = run_to_end(gate.evaluate_slices(adapter, [], []))
    assert evaluation.canary_lost == [FRANCE], evaluation.as_dict()
    drop = evaluation.canary_drops[FRANCE]
    assert drop <= GateConfig().canary_max_drop, drop  # under the nats bound: the new test is what blocks it
    assert not evaluation.promoted
    assert evaluation.reason == f"canary {FRANCE!r}: the model no longer answers ' Paris' (lost {drop:.2f} nats)"
    assert evaluation.as_dict()["canary_lost"] == [FRANCE]


def test_a_named_adapter_is_held_to_itself_as_loaded_not_to_the_base_model(smollm2):
    """A named adapter's trainer gives the gate the adapter as loaded as its reference: that adapter's own distance
    from the base model is no regression (held to the base model, it would be refused)."""
    model, tok = smollm2.model, smollm2.tokenizer
    loaded = LoraAdapter(model.config, seed=3)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for b in loaded.B.values():
            b.copy_(torch.randn(b.shape, generator=g) * 0.3)
    to_base = run_to_end(EvaluationGate(model, tok, GateConfig()).evaluate_slices(loaded, [], []))
    assert not to_base.promoted and to_base.heldout_ppl_rise > 0, to_base.as_dict()
    to_itself = run_to_end(EvaluationGate(model, tok, GateConfig(), reference=loaded).evaluate_slices(loaded, [], []))
    assert to_itself.promoted and to_itself.heldout_ppl_rise == 0.0, to_itself.as_dict()
    assert set(to_itself.canary_drops.values()) == {0.0}


def test_the_base_values_are_kept_between_gates_under_a_key_of_what_they_depend_on(tmp_path):
    """A gate computes the base model's values once and leaves them in its cache directory; another gate of the same
    model (a later start) reads them without a forward; a torn file is computed again and replaced; another group
    size is another key. A tiny random model with the default model's tokenizer and chat template: the values' size,
    not their sense, is what is kept."""
    loaded = load_model(str(make_tiny_chat_dir(tmp_path / "model")), dtype="float32", device="cpu")
    model, tok = loaded.model, loaded.tokenizer
    tmp_path = tmp_path / "cache"

    def base(gate: EvaluationGate) -> tuple[tuple, int]:
        return run_counting(gate._base_values_slices())

    computed, steps = base(EvaluationGate(model, tok, GateConfig(), cache_dir=tmp_path))
    assert steps > 0 and len(computed[1]) == len(computed[2]) > 0
    (path,) = tmp_path.glob("gate-base-*.json")
    assert base(EvaluationGate(model, tok, GateConfig(), cache_dir=tmp_path)) == (computed, 0)
    path.write_text('{"nll": 1.0, "canar')
    again, steps = base(EvaluationGate(model, tok, GateConfig(), cache_dir=tmp_path))
    assert again == computed and steps > 0 and json.loads(path.read_text())["nll"] == computed[0]
    _, steps = base(EvaluationGate(model, tok, GateConfig(), group_size=2, cache_dir=tmp_path))
    assert steps > 0 and len(list(tmp_path.glob("gate-base-*.json"))) == 2
