"""The named-adapter registry on a tiny random model (fp32): at most max_loras adapters in the engine, the least
recently used idle one evicted for a page-in, a request that finds every slot held waits instead of failing, paged
answers equal each adapter's served alone, and bad registrations are refused with a ValueError.

    pytest tests/runtime/test_adapter_registry.py
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from alchemist.config import EngineConfig
from alchemist.engine import LLMEngine, SamplingParams
from alchemist.model.llama import Llama
from alchemist.model.loader import build_model
from alchemist.model.peft_format import load_adapter, save_adapter
from alchemist.runtime.adapter_registry import AdapterRegistry
from tests.engine.helpers import char_tokenizer, random_adapter, random_prompts

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_model(tiny_dirs) -> Llama:
    return build_model(tiny_dirs["llama-gqa-untied"], torch.float32)


@pytest.fixture(scope="module")
def adapter_dirs(tiny_model, tmp_path_factory) -> dict[str, Path]:
    """Five PEFT adapter directories with random non-zero B: team-0 .. team-4."""
    root = tmp_path_factory.mktemp("adapters")
    dirs = {}
    for i in range(5):
        dirs[f"team-{i}"] = root / f"team-{i}"
        save_adapter(random_adapter(tiny_model, seed=100 + i, std=0.2), dirs[f"team-{i}"])
    return dirs


def engine_of(model: Llama) -> LLMEngine:
    return LLMEngine(model, char_tokenizer(), EngineConfig(max_num_seqs=4))


def registry_of(model: Llama, dirs: dict[str, Path], max_loras: int, **kwargs) -> AdapterRegistry:
    registry = AdapterRegistry(engine_of(model), max_loras, reserved=["tiny"], **kwargs)
    for name, path in dirs.items():
        registry.register(name, path)
    return registry


def test_the_least_recently_used_idle_adapter_is_evicted(tiny_model, adapter_dirs):
    registry = registry_of(tiny_model, adapter_dirs, max_loras=2)

    async def scenario() -> None:
        for name in ("team-0", "team-1", "team-0"):  # team-1 is now the least recently used
            await registry.acquire(name)
            registry.release(name)
        await registry.acquire("team-2")
        assert set(registry.engine.named_adapters) == {"team-0", "team-2"}
        registry.release("team-2")

    asyncio.run(scenario())
    assert (registry.num_loads, registry.num_evictions, registry.num_in_engine) == (3, 1, 2)
    # the last max_cpu_loras (2) read stay in memory: team-1, evicted, pages in again without a disk read
    assert {name: registry.residence(name) for name in adapter_dirs} == {
        "team-0": "engine", "team-1": "memory", "team-2": "engine", "team-3": "disk", "team-4": "disk"}  # fmt: skip


def test_a_request_waits_while_every_slot_is_held(tiny_model, adapter_dirs):
    registry = registry_of(tiny_model, adapter_dirs, max_loras=1)

    async def scenario() -> None:
        await registry.acquire("team-0")  # held: a request in flight
        waiting = asyncio.ensure_future(registry.acquire("team-1"))
        for _ in range(20):
            await asyncio.sleep(0)
        assert not waiting.done() and registry.num_evictions == 0
        registry.release("team-0")
        await asyncio.wait_for(waiting, 5)
        assert list(registry.engine.named_adapters) == ["team-1"]

    asyncio.run(scenario())
    assert registry.num_evictions == 1


def test_paged_answers_equal_each_adapter_served_alone(tiny_model, adapter_dirs):
    registry = registry_of(tiny_model, adapter_dirs, max_loras=2, max_cpu_loras=2)
    prompts = random_prompts([7, 13], seed=3)
    order = [f"team-{i}" for i in range(5)] * 2  # two rounds: every adapter is evicted and paged in again

    async def scenario() -> dict[str, list[list[int]]]:
        answers: dict[str, list[list[int]]] = {}
        for name in order:
            await registry.acquire(name)
            outs = registry.engine.generate(prompts, GREEDY, adapter_name=name)
            registry.release(name)
            answers.setdefault(name, []).append([out.output_token_ids for out in outs])
        return answers

    answers = asyncio.run(scenario())
    assert registry.num_loads == 10 and registry.num_evictions == 8
    assert registry.num_disk_reads == 5 + 10  # the registrations, then every page-in (only 2 are kept read)
    for name, (first, second) in answers.items():
        alone = engine_of(tiny_model)
        alone.set_adapter(load_adapter(adapter_dirs[name], tiny_model.config), 1)
        want = [out.output_token_ids for out in alone.generate(prompts, GREEDY)]
        assert first == second == want, name
    assert len({str(first) for first, _ in answers.values()}) == 5  # the adapters do answer differently


def test_unload_takes_the_adapter_out_of_the_engine(tiny_model, adapter_dirs):
    registry = registry_of(tiny_model, {"team-0": adapter_dirs["team-0"]}, max_loras=2)

    async def scenario() -> None:
        await registry.acquire("team-0")
        registry.release("team-0")
        registry.unload("team-0")
        with pytest.raises(KeyError):
            await registry.acquire("team-0")

    asyncio.run(scenario())
    assert registry.engine.named_adapters == {} and registry.num_in_engine == 0
    with pytest.raises(KeyError):
        registry.unload("team-0")
    registry.register("team-0", adapter_dirs["team-1"])  # the name is free again, under a new version
    assert registry._entries["team-0"].version == 2


@pytest.mark.parametrize(
    "name, path, problem",
    [
        ("team-0", "team-1", "loaded already"),
        ("tiny", "team-1", "base model"),
        ("base", "team-1", "base model"),
        ("no spaces", "team-1", "letters, digits"),
        ("fresh", "missing", "not a directory"),
    ],
)
def test_bad_registrations_are_refused(tiny_model, adapter_dirs, name, path, problem):
    registry = registry_of(tiny_model, {"team-0": adapter_dirs["team-0"]}, max_loras=1)
    with pytest.raises(ValueError, match=problem):
        registry.register(name, adapter_dirs.get(path, Path("/nonexistent")))


def test_an_adapter_of_another_model_is_refused(tiny_model, tiny_dirs, tmp_path):
    other = build_model(tiny_dirs["llama-mha-tied"], torch.float32)  # 4 KV heads, not 2: other k/v shapes
    save_adapter(random_adapter(other, seed=1), tmp_path / "other")
    registry = AdapterRegistry(engine_of(tiny_model), 1)
    with pytest.raises(ValueError, match="another base model"):
        registry.register("other", tmp_path / "other")
