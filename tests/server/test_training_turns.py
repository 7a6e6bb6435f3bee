"""Training beside serving takes its time in turns (``TimeShare``, run by ``AsyncEngine``'s stepping thread): while
requests are in flight, training's credit is spent in runs of slices up to the quantum, not in a slice after every
engine step; an arriving request ends a turn after the slice in progress, and one that arrived during a step is
scheduled before any slice. The engine is the real one over the tiny model; the background work is the test's own
(slices of known length) behind the protocol the online trainer implements."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from alchemist.config import EngineConfig
from alchemist.engine import LLMEngine, SamplingParams
from alchemist.model.loader import build_model
from alchemist.runtime import time_share
from alchemist.runtime.async_engine import AsyncEngine
from alchemist.runtime.time_share import TimeShare
from tests.engine.helpers import char_tokenizer

SLICE_S = 0.002


class Slices:
    """Background work with slices of ``SLICE_S`` (as reported) to run from the first engine step until the request is
    done (with serving idle, training runs slice after slice: not what is tested here). Logs slices and engine
    steps in the order they happen (both in the stepping thread). ``add_at``: the slice that adds a request."""

    def __init__(
        self, engine: LLMEngine, add_at: int | None = None, add_at_step: int | None = None, add_every_step=False,
        step_pad_s: float = 0.0,
    ) -> None:
        self.engine, self.add_at, self.add_at_step, self.add_every_step = engine, add_at, add_at_step, add_every_step
        self.step_pad_s = step_pad_s  # a step lasts this much longer (the callback runs inside the timed step)
        self.events: list[tuple[str, float]] = []  # ("step", 0.0) | ("slice" or "slice+add", seconds)
        self.observed: list[tuple[str, float, bool]] = []  # what the metrics hooks were told: ("slice", s, serving)
        self.active = self.done = False

    def has_work(self) -> bool:
        return self.active

    def run_slice(self) -> float:
        # A slice reports SLICE_S, what TimeShare counts, without spinning for it: a spin timed on a shared machine
        # lasted whatever the scheduler gave it (one preempted slice filled a 10 ms turn alone), so the turns the
        # tests count depended on the load. Only idle slices (serving has nothing in flight: after the request,
        # before the test stops the work) wait, so that they do not run back to back; nothing reads how long.
        if not self.engine.has_unfinished():
            time.sleep(SLICE_S)
        kind = "slice"
        if self.add_at is not None and sum(e[0] != "step" for e in self.events) == self.add_at:
            self.engine.add_request("arrival", [3, 4, 5], SamplingParams(max_tokens=4, ignore_eos=True))
            kind = "slice+add"
        self.events.append((kind, SLICE_S))
        return SLICE_S

    def on_step(self, outputs) -> None:
        if self.step_pad_s:
            time.sleep(self.step_pad_s)
        kind = "step"
        steps = sum(e[0] != "slice" for e in self.events)
        if (self.add_at_step is not None and steps == self.add_at_step) or (self.add_every_step and not self.done):
            params = SamplingParams(max_tokens=4, ignore_eos=True)
            self.engine.add_request(f"arrival-{steps}", [3, 4, 5], params)
            kind = "step+add"  # as if it arrived during the step: the next step schedules it
        self.events.append((kind, self.step_pad_s))
        self.active = not self.done

    def turns(self) -> list[list[tuple[str, float]]]:
        """Runs of consecutive slices with an engine step after them."""
        turns, current = [], []
        for event in self.events:
            if event[0].startswith("step"):
                if current:
                    turns.append(current)
                current = []
            else:
                current.append(event)
        return turns


def serve(
    tiny_dirs, quantum_s: float, add_at: int | None = None, add_at_step: int | None = None, add_every_step=False,
    step_pad_s: float = 0.0,
) -> Slices:
    model = build_model(tiny_dirs["llama-gqa-untied"], torch.float32)
    engine = LLMEngine(model, char_tokenizer(), EngineConfig(max_num_seqs=4, max_model_len=512))
    work = Slices(engine, add_at, add_at_step, add_every_step, step_pad_s)

    async def one_request() -> None:
        on_slice = lambda s, serving: work.observed.append(("slice", s, serving))  # noqa: E731
        on_step_s = lambda s: work.observed.append(("step", s, True))  # noqa: E731
        share = TimeShare(work, engine.has_arrivals, share=0.5, quantum_s=quantum_s, on_slice=on_slice)
        async_engine = AsyncEngine(engine, on_outputs=work.on_step, time_share=share, on_step_s=on_step_s)
        async_engine.start()
        try:
            params = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)
            async for _ in async_engine.generate("long", [1, 2, 3], params):
                pass
        finally:
            work.done, work.active = True, False
            async_engine.shutdown()

    asyncio.run(one_request())
    return work


@pytest.fixture
def credit_never_full(monkeypatch):
    """The turns' own rules, apart from the full-credit one (a busy machine's slow steps can fill the credit)."""
    monkeypatch.setattr(time_share, "MAX_CREDIT_S", 1e6)


@pytest.mark.parametrize("quantum_s", [0.02, 0.01])
def test_training_takes_turns_of_the_quantum(tiny_dirs, quantum_s, credit_never_full):
    turns = serve(tiny_dirs, quantum_s).turns()
    assert len(turns) >= 3
    for turn in turns:
        spent = sum(took for _, took in turn)
        # A turn starts with credit >= the quantum and ends once the credit is spent or the quantum used up:
        # either way it lasts at least the quantum, and it stops at the slice that crosses it.
        assert spent >= quantum_s
        assert spent - turn[-1][1] < quantum_s
        assert len(turn) >= 2


def test_without_a_quantum_a_slice_follows_a_step(tiny_dirs, credit_never_full):
    turns = serve(tiny_dirs, 0.0).turns()
    assert len(turns) >= 3 and all(len(turn) == 1 for turn in turns)


def test_the_metrics_hooks_see_every_step_and_slice(tiny_dirs, credit_never_full):
    """/metrics' engine_step_seconds and training_slice_seconds are fed by these hooks: each step's time and each
    slice's, in the order they ran, a slice with serving=True while the request was in flight (every slice before
    the last engine step; after it the stepping thread may run idle slices before the test stops the work)."""
    work = serve(tiny_dirs, 0.0)
    slices = [took for kind, took in work.events if kind.startswith("slice")]
    assert len(slices) >= 3
    assert [s for kind, s, _ in work.observed if kind == "slice"] == slices
    assert [k for k, _, _ in work.observed] == ["step" if k.startswith("step") else "slice" for k, _ in work.events]
    last_step = max(i for i, (kind, _, _) in enumerate(work.observed) if kind == "step")
    assert all(serving for kind, _, serving in work.observed[:last_step] if kind == "slice")
    # a step's time as the engine thread timed it, the test's own pad (inside the timed step) included
    assert all(s > 0 for k, s, _ in work.observed if k == "step")


def test_an_arriving_request_ends_the_turn(tiny_dirs, credit_never_full):
    turns = serve(tiny_dirs, 0.05, add_at=3).turns()  # a whole turn is >= 25 slices; the 4th adds a request
    assert turns[0][-1][0] == "slice+add" and len(turns[0]) == 4  # the first turn, cut short after the arrival
    assert all(sum(took for _, took in turn) >= 0.05 for turn in turns[1:])


def test_a_request_that_arrived_during_a_step_is_scheduled_before_a_slice(tiny_dirs, credit_never_full):
    events = serve(tiny_dirs, 0.0, add_at_step=5).events
    kinds = [kind for kind, _ in events]
    at = kinds.index("step+add")
    assert kinds[at + 1] == "step"  # the arrival's prefill comes first; the slice it would have had waits
    assert "slice" in kinds[:at] and "slice" in kinds[at + 1 :]  # a slice follows steps before and after


def test_arrivals_during_every_step_do_not_starve_training(tiny_dirs, monkeypatch):
    # A closed-loop load has a request arriving during nearly every step; once training's credit is full it takes
    # its turn anyway (a small cap here, so that the tiny model's millisecond steps fill it within the test).
    monkeypatch.setattr(time_share, "MAX_CREDIT_S", 0.01)
    kinds = [kind for kind, _ in serve(tiny_dirs, 0.0, add_every_step=True).events]
    assert kinds.count("step+add") >= 100
    assert kinds.count("slice") >= 3  # without the full-credit rule: none


def test_under_arrivals_at_every_step_training_gets_its_share(tiny_dirs, monkeypatch):
    # Steps of 10+ ms, slices of 2 ms, share 0.5: training's time should about equal serving's. Spending a full
    # credit one slice a step (what a step earned past full was lost) gave it one slice a step: about a fifth.
    monkeypatch.setattr(time_share, "MAX_CREDIT_S", 0.01)
    events = serve(tiny_dirs, 0.0, add_every_step=True, step_pad_s=0.01).events
    steps = [e for e in events if e[0].startswith("step")]
    training_s = sum(took for kind, took in events if kind.startswith("slice"))
    assert len(steps) >= 100
    assert training_s >= 0.6 * sum(took for _, took in steps)  # the steps' time is at least their padding
