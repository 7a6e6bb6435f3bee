"""Block accounting: a free list of fixed-size blocks, the lowest free slot first, usage as a fraction."""

from __future__ import annotations

import torch

from alchemist.engine.block_manager import BlockManager
from alchemist.engine.sequence import SamplingParams, Sequence
from alchemist.model.tokenizer import IncrementalDetokenizer
from tests.engine.helpers import char_tokenizer


def make_seq(name: str, num_prompt: int) -> Sequence:
    detok = IncrementalDetokenizer(char_tokenizer(), [])
    return Sequence(name, [1] * num_prompt, SamplingParams(temperature=0), 8, detok, 0.0, torch.device("cpu"))


def test_blocks_grow_with_tokens_and_come_back():
    bm = BlockManager(num_slots=2, num_blocks=6, block_size=4)
    a = make_seq("a", 10)
    assert bm.can_allocate(a, 10)
    slot = bm.allocate(a, 10)
    a.admit(slot, 0.0)
    assert slot == 0 and len(a.block_ids) == 3 and bm.usage == 0.5
    a.advance(10)
    assert bm.can_append(a, 2) and bm.can_append(a, 14) and not bm.can_append(a, 15)
    bm.append(a, 2)  # 12 tokens: still 3 blocks
    assert len(a.block_ids) == 3
    bm.append(a, 3)  # 13 tokens: a fourth
    assert len(a.block_ids) == 4 and bm.num_free_blocks == 2
    assert len(set(a.block_ids)) == 4
    bm.free(a)
    assert bm.num_free_blocks == 6 and bm.num_free_slots == 2 and bm.usage == 0.0 and a.block_ids == []


def test_lowest_free_slot_keeps_live_slots_compact():
    bm = BlockManager(num_slots=4, num_blocks=100, block_size=16)
    seqs = [make_seq(str(i), 5) for i in range(4)]
    for s in seqs[:3]:
        s.admit(bm.allocate(s, 5), 0.0)
    assert [s.slot for s in seqs[:3]] == [0, 1, 2]
    bm.free(seqs[1])
    seqs[1].preempt()
    seqs[3].admit(bm.allocate(seqs[3], 5), 0.0)
    assert seqs[3].slot == 1


def test_no_slot_or_no_blocks_means_no_admission():
    bm = BlockManager(num_slots=1, num_blocks=2, block_size=4)
    a, b = make_seq("a", 4), make_seq("b", 4)
    assert not bm.can_allocate(a, 9)  # 3 blocks > 2
    a.admit(bm.allocate(a, 4), 0.0)
    assert not bm.can_allocate(b, 1)  # blocks left, but no slot
