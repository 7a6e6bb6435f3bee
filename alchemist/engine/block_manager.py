"""KV-cache accounting: slots for placement, fixed-size blocks for capacity.

The storage (``alchemist.model.attention.KVCache``) keeps each sequence's keys and values contiguous in its slot,
so attention reads a slot as a view. Gathering paged blocks into a contiguous tensor every decode step was
measured 27-49% slower on the target CPU (docs/architecture.md), so blocks here are accounting only: a sequence
holds ``ceil(tokens / block_size)`` blocks from a free list, and the pool (``num_kv_blocks``) is the memory
budget that admission and preemption respect. With the default pool every slot can fill to ``max_model_len``;
a smaller pool makes sequences share capacity and forces preemption under load.

Live slots are kept compact (the lowest free slot is always taken) because batched decode attends over the slot
range ``lo .. hi`` and computes a throw-away row for every idle slot inside it.
"""

from __future__ import annotations

import heapq
from collections import deque

from alchemist.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_slots: int, num_blocks: int, block_size: int) -> None:
        self.num_slots = num_slots
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free_slots = list(range(num_slots))  # a heap: the lowest free slot comes out first
        self._free_blocks: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_blocks)

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    @property
    def usage(self) -> float:
        """Fraction of the block pool held by sequences (vLLM's kv_cache_usage_perc)."""
        return 1.0 - len(self._free_blocks) / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _num_new_blocks(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks ``seq`` lacks to hold its computed tokens plus ``num_tokens`` more."""
        return max(0, self.blocks_for(seq.num_computed_tokens + num_tokens) - len(seq.block_ids))

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether a waiting ``seq`` can get a slot and the blocks for its first ``num_tokens``."""
        return bool(self._free_slots) and self._num_new_blocks(seq, num_tokens) <= len(self._free_blocks)

    def allocate(self, seq: Sequence, num_tokens: int) -> int:
        """Reserves the lowest free slot and the blocks for ``num_tokens``; returns the slot."""
        assert seq.slot is None and not seq.block_ids and self.can_allocate(seq, num_tokens)
        slot = heapq.heappop(self._free_slots)
        self.append(seq, num_tokens)
        return slot

    def can_append(self, seq: Sequence, num_tokens: int) -> bool:
        return self._num_new_blocks(seq, num_tokens) <= len(self._free_blocks)

    def append(self, seq: Sequence, num_tokens: int) -> None:
        """Grows ``seq``'s blocks to hold ``num_tokens`` more tokens."""
        n = self._num_new_blocks(seq, num_tokens)
        assert n <= len(self._free_blocks)
        seq.block_ids.extend(self._free_blocks.popleft() for _ in range(n))

    def free(self, seq: Sequence) -> None:
        """Returns ``seq``'s blocks and slot (call before the sequence is preempted or finished)."""
        self._free_blocks.extend(seq.block_ids)
        seq.block_ids.clear()
        if seq.slot is not None:
            heapq.heappush(self._free_slots, seq.slot)
