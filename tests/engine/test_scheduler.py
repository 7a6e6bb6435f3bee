"""The scheduler on its own (no model): token budget, decodes first, chunked prefill, FCFS, preempt the newest.

Each simulated step does what the engine does after the forward: advance every scheduled sequence and append a
token to those that reached the end of their tokens.
"""

from __future__ import annotations

import torch

from alchemist.engine.block_manager import BlockManager
from alchemist.engine.scheduler import MIN_PREFILL_TOKENS, ScheduledBatch, Scheduler
from alchemist.engine.sequence import SamplingParams, Sequence
from alchemist.model.tokenizer import IncrementalDetokenizer
from tests.engine.helpers import char_tokenizer


def make_seq(name: str, num_prompt: int) -> Sequence:
    detok = IncrementalDetokenizer(char_tokenizer(), [])
    return Sequence(name, [1] * num_prompt, SamplingParams(temperature=0), 1000, detok, 0.0, torch.device("cpu"))


def simulate(scheduler: Scheduler) -> ScheduledBatch:
    batch = scheduler.schedule(now_s=0.0)
    for seq, num in zip(batch.seqs, batch.num_tokens, strict=True):
        seq.advance(num)
        if seq.num_uncomputed_tokens == 0:
            seq.append_token(7, None, 0.0)
    return batch


def test_budget_chunks_long_prompts_and_never_stalls_decodes():
    scheduler = Scheduler(BlockManager(8, 1000, 16), max_num_seqs=8, max_num_batched_tokens=64)
    short = [make_seq(f"s{i}", 10) for i in range(3)]
    long = make_seq("long", 300)
    for seq in [*short, long]:
        scheduler.add(seq)
    first = simulate(scheduler)
    assert first.num_tokens == [10, 10, 10, 34]  # FCFS admission; the long prompt gets what the budget leaves
    steps = 1
    while long.num_output_tokens == 0:
        batch = simulate(scheduler)
        steps += 1
        assert batch.total_tokens <= 64
        # The three short ones decode in every step, ahead of the long prompt's chunk.
        assert batch.seqs[:3] == short and batch.num_tokens[:3] == [1, 1, 1]
        assert batch.seqs[3] is long and batch.num_tokens[3] == min(
            61, long.num_prompt_tokens - (34 + 61 * (steps - 2))
        )
    assert steps == 1 + -(-(300 - 34) // 61)


def test_waiting_requests_are_admitted_first_come_first_served():
    scheduler = Scheduler(BlockManager(2, 1000, 16), max_num_seqs=2, max_num_batched_tokens=100)
    seqs = [make_seq(f"r{i}", 20) for i in range(4)]
    for seq in seqs:
        scheduler.add(seq)
    assert simulate(scheduler).seqs == seqs[:2]  # two slots
    scheduler.remove(seqs[1])
    seqs[1].finish("stop", 0.0)
    batch = simulate(scheduler)
    assert batch.seqs == [seqs[0], seqs[2]] and seqs[2].slot == 1


def test_out_of_blocks_preempts_the_newest_and_requeues_it_first():
    # 4 blocks of 4 tokens: three sequences of 4 tokens hold 1 block each, then each decode step needs a new one.
    bm = BlockManager(3, 4, 4)
    scheduler = Scheduler(bm, max_num_seqs=3, max_num_batched_tokens=16)
    seqs = [make_seq(f"r{i}", 4) for i in range(3)]
    for seq in seqs:
        scheduler.add(seq)
    simulate(scheduler)  # prefill all: 3 blocks used, each has 5 tokens (4 computed + 1 sampled)
    batch = simulate(scheduler)  # r0 takes the last block; r1 needs one: r2 (the newest) is preempted
    assert batch.preempted == [seqs[2]] and batch.seqs == seqs[:2]
    assert list(scheduler.waiting) == [seqs[2]] and seqs[2].num_computed_tokens == 0 and seqs[2].slot is None
    assert scheduler.num_preemptions == 1 and bm.num_free_blocks == 0
    # r2 comes back (recomputing prompt and its output token) once r0 and r1 are done.
    for seq in seqs[:2]:
        scheduler.remove(seq)
        seq.finish("stop", 0.0)
    batch = simulate(scheduler)
    assert batch.seqs == [seqs[2]] and batch.num_tokens == [5]


def test_the_prefill_cap_binds_only_while_decodes_run():
    """``prefill_cap(num_decodes)`` (the engine's, from the latency objective) caps the prompt tokens of a step that
    has decodes, never below MIN_PREFILL_TOKENS; a step without decodes takes the whole budget."""
    scheduler = Scheduler(BlockManager(8, 1000, 16), max_num_seqs=8, max_num_batched_tokens=256)
    asked: list[int] = []

    def cap(num_decodes: int) -> int:
        asked.append(num_decodes)
        return 40

    alone = make_seq("alone", 300)
    scheduler.add(alone)
    assert scheduler.schedule(0.0, prefill_cap=cap).num_tokens == [256]  # no decode: the whole budget
    assert asked == []
    scheduler.remove(alone)
    short, long = make_seq("short", 10), make_seq("long", 300)
    scheduler.add(short)
    simulate(scheduler)  # short is prefilled, and decodes from now on
    scheduler.add(long)
    chunks = []
    while long.num_output_tokens == 0:
        batch = scheduler.schedule(0.0, prefill_cap=cap)
        assert batch.seqs[0] is short and batch.num_tokens[0] == 1  # the decode goes first, every step
        chunks.append(batch.num_tokens[1])
        for seq, num in zip(batch.seqs, batch.num_tokens, strict=True):
            seq.advance(num)
            if seq.num_uncomputed_tokens == 0:
                seq.append_token(7, None, 0.0)
    assert chunks == [40] * 7 + [20] and set(asked) == {1}
    zero = Scheduler(BlockManager(8, 1000, 16), max_num_seqs=8, max_num_batched_tokens=256)
    short, long = make_seq("short", 10), make_seq("long", 300)
    zero.add(short)
    simulate(zero)
    zero.add(long)
    batch = zero.schedule(0.0, prefill_cap=lambda num_decodes: 0)  # the decodes alone fill the objective
    assert batch.num_tokens == [1, MIN_PREFILL_TOKENS]
    assert zero.schedule(0.0, prefill_cap=lambda num_decodes: None).num_tokens == [1, 255]  # no estimate: no cap
