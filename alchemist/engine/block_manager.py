"""KV-cache accounting: slots for placement, fixed-size blocks for capacity.

The storage (``alchemist.model.attention.KVCache``) keeps each sequence's keys and values contiguous in its slot,
so attention reads a slot as a view. Gathering paged blocks into a contiguous tensor every decode step measured
slower on the target CPU (docs/benchmarks.md, "Paged KV storage"), so blocks here are accounting only: a sequence
holds ``ceil(tokens / block_size)`` blocks from a free list, and the pool (``num_kv_blocks``) is the memory
budget that admission and preemption respect. With the default pool every slot can fill to ``max_model_len``;
a smaller pool makes sequences share capacity and forces preemption under load.

Slots: without prefix caching the lowest free slot is taken, which keeps live slots compact. With it
(``alchemist.engine.prefix_cache``) a sequence whose prompt starts with blocks cached in a free slot takes that
slot, and one without takes an empty slot, else the least recently used one, so live slots may leave holes. Our
bf16 CPU decode kernel attends per row and does not care; ATen's batched decode call (fp32, GPUs) attends over the
slot range ``lo .. hi`` and computes a throw-away row for every idle slot inside it, which is only a cost.
"""

from __future__ import annotations

from collections import deque

from alchemist.engine.prefix_cache import PrefixCache, PrefixHit
from alchemist.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_slots: int, num_blocks: int, block_size: int, prefix_caching: bool = False) -> None:
        self.num_slots = num_slots
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free_slots = set(range(num_slots))
        self._free_blocks: deque[int] = deque(range(num_blocks))
        self.prefix_cache = PrefixCache(num_slots, block_size) if prefix_caching else None

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

    def lookup(self, seq: Sequence, adapter_version: int) -> PrefixHit | None:
        """The longest cached prefix of a waiting ``seq``'s tokens under its adapter at ``adapter_version``; None
        when no lookup is made: prefix caching is off, or ``seq`` is recorded (its record must hold every prompt
        row, so its prompt is computed whole; docs/architecture.md)."""
        if self.prefix_cache is None or seq.record:
            return None
        # a routed request (resumed after preemption) computes its answer rows again: only its prompt may match
        tokens = seq.token_ids[: seq.num_prompt_tokens] if seq.routed else seq.token_ids
        return self.prefix_cache.match(tokens, adapter_version, self._free_slots, seq.adapter_name)

    def allocate(self, seq: Sequence, num_tokens: int, hit: PrefixHit | None = None) -> int:
        """Reserves a slot and the blocks for ``seq``'s first ``num_tokens`` (the cached ones of ``hit`` included);
        returns the slot: the hit's own when it is free (its keys/values are in place), else a free one (the
        caller copies the hit's keys/values there)."""
        assert seq.slot is None and not seq.block_ids and self.can_allocate(seq, num_tokens)
        cache = self.prefix_cache
        if cache is None:
            slot = min(self._free_slots)
        elif hit is not None and hit.slot in self._free_slots:
            slot = hit.slot
        else:
            slot = cache.pick_free(self._free_slots)
        self._free_slots.remove(slot)
        if cache is not None:
            cache.assign(slot, hit.hashes if hit is not None else ())
            if hit is not None:
                cache.num_queries += seq.num_tokens
                cache.num_hits += hit.num_tokens
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
            self._free_slots.add(seq.slot)
            if self.prefix_cache is not None:
                self.prefix_cache.release(seq.slot)
