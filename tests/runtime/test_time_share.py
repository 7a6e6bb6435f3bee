"""Training's time beside serving (``TimeShare``): what the latency objective leaves after each engine step, no slice
that a request waiting for admission would wait past its TTFT for, a slice anyway after being kept out too long, and
the idle machine whole. First the policy alone on a controllable clock (slices of given lengths, given step times);
then in ``AsyncEngine``'s stepping thread over the real engine on the tiny model, with the test's own background
work behind the protocol the online trainer implements."""

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
from alchemist.runtime.objective import LatencyObjective
from alchemist.runtime.time_share import MAX_KEPT_OUT_S, TimeShare
from tests.engine.helpers import char_tokenizer

SLICE_S = 0.008


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Work:
    """Slices of ``SLICE_S`` on the test's clock; records when each started."""

    def __init__(self, clock: Clock, slices: int = 1000) -> None:
        self.clock, self.left, self.started = clock, slices, []
        self.slice_s = SLICE_S

    def has_work(self) -> bool:
        return self.left > 0

    def run_slice(self) -> float:
        self.started.append(self.clock.now)
        self.clock.now += self.slice_s
        self.left -= 1
        return self.slice_s


def policy(
    tpot_s: float, ttft_s: float = 10.0, waiting_since=lambda: None, step_share: float = 0.0
) -> tuple[TimeShare, Work, Clock]:
    clock = Clock()
    work = Work(clock)
    return TimeShare(work, LatencyObjective(tpot_s, ttft_s, step_share), waiting_since, clock), work, clock


def step(share: TimeShare, clock: Clock, step_s: float) -> int:
    """An engine step of ``step_s`` with requests in flight; returns the slices run after it."""
    clock.now += step_s
    before = len(share.work.started)
    share.after_step(step_s)
    return len(share.work.started) - before


def test_slices_run_in_what_the_objective_leaves_and_never_past_it():
    share, _, clock = policy(tpot_s=0.050)
    assert step(share, clock, 0.030) == 2  # 20 ms left: 8 + 8, and the next 8 would end past the objective
    assert step(share, clock, 0.045) == 1  # 5 ms left, and the 4 left before: a slice of 8 fits (1 ms left)
    assert step(share, clock, 0.020) == 3  # 31 ms
    assert step(share, clock, 0.050) == 0  # at the objective: nothing more (7 ms kept)
    assert step(share, clock, 0.060) == 0 and share.credit_s == pytest.approx(-0.003)  # a step over it spends it


def test_a_slack_shorter_than_a_slice_adds_up_over_steps_and_no_mean_past_the_objective():
    """Steps 3 ms short of the objective, slices of 8: a slice every few steps, and a token's mean time (a step and
    the slices after it) never past the objective over any run of steps from the start."""
    share, work, clock = policy(tpot_s=0.050)
    share.slice_s = SLICE_S  # slices as long as the last ones
    ran = [step(share, clock, 0.047) for _ in range(40)]
    assert ran[:6] == [0, 0, 1, 0, 0, 1] and sum(ran) == 40 * 3 // 8
    spent = 0.0
    for n, slices in enumerate(ran, start=1):
        spent += 0.047 + slices * SLICE_S
        assert spent <= n * 0.050 + 1e-9


def test_credit_is_kept_up_to_a_slice_or_an_objective_and_a_slice_past_it_is_owed():
    share, work, clock = policy(tpot_s=0.050)
    work.left = 0
    assert step(share, clock, 0.010) == 0 and share.credit_s == 0.0  # no work: nothing is kept for later
    work.left, work.slice_s, share.slice_s = 1000, 0.200, 0.200  # slices of 200 ms lately
    assert [step(share, clock, 0.010) for _ in range(6)] == [0, 0, 0, 0, 1, 0]  # 40 ms a step, kept up to 200
    assert [step(share, clock, 0.010) for _ in range(3)] == [0, 0, 0] and share.credit_s == pytest.approx(0.160)
    work.slice_s = 0.300  # the next slice outlasts the estimate: 100 ms owed, and the estimate grows to 230
    assert step(share, clock, 0.010) == 1 and share.credit_s == pytest.approx(-0.100)
    assert [step(share, clock, 0.010) for _ in range(9)] == [0] * 8 + [1]  # (230 + 100) / 40 steps


def test_saturated_serving_keeps_training_out_but_for_a_slice_after_a_long_wait():
    share, work, clock = policy(tpot_s=0.050)
    ran = [step(share, clock, 0.060) for _ in range(40)]  # every step over the objective, for 2.4 s
    assert sum(ran) == 2 and ran.index(1) == 17  # one slice each time training was kept out a second
    assert work.started[0] - 100.0 >= MAX_KEPT_OUT_S


def test_under_a_derived_objective_training_adds_its_share_of_steps_over_it():
    """Steps of 60 ms over a 50 ms objective that was derived (``step_share`` 0.1): a slice of 8 ms whenever a tenth
    of the steps since adds up to it, so a token's mean time is never past 1.1 x its step's."""
    share, work, clock = policy(tpot_s=0.050, step_share=0.1)
    share.slice_s = SLICE_S
    ran = [step(share, clock, 0.060) for _ in range(40)]
    assert ran[:5] == [0, 1, 1, 1, 0] and sum(ran) == 40 * 6 // 8
    spent = 0.0
    for n, slices in enumerate(ran, start=1):
        spent += 0.060 + slices * SLICE_S
        assert spent <= n * 0.060 * 1.1 + 1e-9
    assert step(share, clock, 0.030) == 2  # under the objective: what it leaves, if more (20 ms + 2 owed before)


def test_without_work_nothing_runs_and_nothing_is_owed():
    share, work, clock = policy(tpot_s=0.050)
    work.left = 0
    for _ in range(40):
        assert step(share, clock, 0.060) == 0
    work.left = 5  # work arrives: kept out from now on, not from the first step
    assert step(share, clock, 0.060) == 0 and share.kept_out_since == clock.now


def test_a_request_waiting_for_admission_goes_first():
    arrived: list[float | None] = [None]
    share, work, clock = policy(tpot_s=0.5, ttft_s=0.100, waiting_since=lambda: arrived[0])
    share.run_slice()  # an idle slice: the estimate is a slice's length now
    arrived[0] = clock.now - 0.095  # waited 95 ms of its 100: a slice would take it past its TTFT
    assert step(share, clock, 0.010) == 0
    arrived[0] = clock.now  # just arrived: slices while they end within its TTFT (12 x 8 ms <= 100 ms)
    assert step(share, clock, 0.0) == 12
    arrived[0] = None  # admitted: the credit, kept up to one objective (500 ms: 62 slices)
    assert step(share, clock, 0.010) == 62
    assert work.left == 1000 - 1 - 12 - 62


# --- in the stepping loop ---------------------------------------------------------------------------------------


class OneSliceAStep:
    """Background work with one slice of ``SLICE_S`` (as reported, without spinning for it: a spin timed on a shared
    machine lasts whatever the scheduler gives it) after each engine step, and ``idle_slices`` more once the test's
    request is done. Logs slices and engine steps in the order they happen (both in the stepping
    thread)."""

    def __init__(self, engine: LLMEngine, idle_slices: int = 0) -> None:
        self.engine, self.idle_slices = engine, idle_slices
        self.events: list[str] = []  # "step" | "slice"
        self.observed: list[tuple[str, float, bool]] = []  # what the metrics hooks were told
        self.owed = False  # a slice is due: an engine step ran since the last one
        self.serving = True

    def has_work(self) -> bool:
        return self.owed or (not self.serving and self.idle_slices > 0)

    def run_slice(self) -> float:
        if self.owed:
            self.owed = False
        else:
            self.idle_slices -= 1
        self.events.append("slice")
        return SLICE_S

    def on_step(self, outputs) -> None:
        self.events.append("step")
        self.owed = True


def serve(tiny_dirs, objective: LatencyObjective, idle_slices: int = 0) -> OneSliceAStep:
    model = build_model(tiny_dirs["llama-gqa-untied"], torch.float32)
    engine = LLMEngine(model, char_tokenizer(), EngineConfig(max_num_seqs=4, max_model_len=512))
    work = OneSliceAStep(engine, idle_slices)

    async def one_request() -> None:
        on_slice = lambda s, serving: work.observed.append(("slice", s, serving))  # noqa: E731
        on_step_s = lambda s: work.observed.append(("step", s, True))  # noqa: E731
        share = TimeShare(work, objective, engine.waiting_since, on_slice=on_slice)
        async_engine = AsyncEngine(engine, on_outputs=work.on_step, time_share=share, on_step_s=on_step_s)
        async_engine.start()
        try:
            params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
            async for _ in async_engine.generate("long", [1, 2, 3], params):
                pass
            work.serving = False
            async_engine.wake()
            deadline = time.monotonic() + 60
            while work.idle_slices > 0:  # serving idle: the loop runs the work's slices, one after another
                assert time.monotonic() < deadline, "the idle machine was not given to training"
                await asyncio.sleep(0.01)
        finally:
            async_engine.shutdown()

    asyncio.run(one_request())
    return work


def test_within_the_objective_a_slice_follows_each_step_and_the_hooks_see_every_one(tiny_dirs):
    """/metrics' engine_step_seconds and training_slice_seconds are fed by these hooks: each step's time and each
    slice's, in the order they ran, a slice with serving=True while the request was in flight."""
    work = serve(tiny_dirs, LatencyObjective(tpot_s=60.0, ttft_s=60.0), idle_slices=5)
    serving = work.events[: work.events.index("step") + 2 * 100]  # a step and its slice for each of 100 tokens
    assert serving == ["step", "slice"] * 100
    assert work.events[200:] == ["slice"] * 5  # then the rest of the work, slice after slice
    assert [kind for kind, _, _ in work.observed] == work.events
    slices = [serving for kind, _, serving in work.observed if kind == "slice"]
    # (an idle slice may run in the last step's turn, told serving=True, if the request's end is seen meanwhile)
    assert len(slices) == 105 and slices[:100] == [True] * 100
    assert all(s > 0 for kind, s, _ in work.observed if kind == "step")


def test_steps_over_the_objective_keep_training_out(tiny_dirs, monkeypatch):
    monkeypatch.setattr(time_share, "MAX_KEPT_OUT_S", 1e6)  # the long-wait slice is the test above's
    work = serve(tiny_dirs, LatencyObjective(tpot_s=1e-9, ttft_s=60.0), idle_slices=3)
    assert work.events[:100] == ["step"] * 100  # no step ends within a nanosecond
    assert work.events[100:] == ["slice"] * 4  # serving idle: training takes the machine (the last step's too)
    assert not any(serving for kind, _, serving in work.observed if kind == "slice")


@pytest.mark.parametrize("waits", ["admission", "prefill", None])
def test_a_request_that_waits_past_its_ttft_keeps_training_out(tiny_dirs, waits):
    """A TTFT of 1 ns: once a request waits for its first token, for admission or for the rest of its prompt's
    prefill (chunked over steps), no slice fits before it has it."""
    model = build_model(tiny_dirs["llama-gqa-untied"], torch.float32)
    config = EngineConfig(max_num_seqs=4, max_model_len=512, max_num_batched_tokens=16)
    engine = LLMEngine(model, char_tokenizer(), config)
    work = OneSliceAStep(engine)
    share = TimeShare(work, LatencyObjective(tpot_s=60.0, ttft_s=1e-9), engine.waiting_since)
    engine.add_request("first", [1, 2, 3], SamplingParams(max_tokens=8, ignore_eos=True))
    engine.step()
    work.owed = True
    if waits == "admission":
        engine.add_request("second", [4, 5, 6], SamplingParams(max_tokens=8, ignore_eos=True))
    if waits == "prefill":  # 40 prompt tokens, 16 a step at most: admitted, its prefill not done after a step
        engine.add_request("second", list(range(4, 44)), SamplingParams(max_tokens=8, ignore_eos=True))
        engine.step()
        assert engine.waiting_since() is not None and not engine.scheduler.waiting
    share.after_step(0.0)
    assert work.events == ([] if waits else ["slice"])
    while engine.waiting_since() is not None:
        engine.step()  # until "second" has its first token: training's slice comes after that step
    share.after_step(0.0)
    assert work.events == ["slice"]
