"""Automatic prefix caching over per-slot storage: which full blocks of keys/values each slot still holds.

As in vLLM, a full block of ``block_size`` tokens is named by a hash chained over every block before it,
``h_i = sha256(h_{i-1} + token ids of block i)``, so equal hashes mean equal tokens from position 0 on. The chain is
seeded with the adapter the blocks were computed under, its name and version (``_seed``): a block computed under
one adapter never serves another (vLLM issue 42125 is that bug, after an adapter reload). Version 0 is the base
model whatever the name (the shared adapter unset, or a request for ``BASE``), so those share their blocks.

Our storage is per slot and contiguous (``KVCache``), so a cached block is not a page of its own: it is a position
range of some slot whose keys/values are still valid. This class knows, per slot, the chain of hashes valid there
and an index from hash to the slots holding it. A slot's blocks stay valid after its sequence finishes, aborts or
is preempted (nothing writes the storage until the slot is given to another sequence) and are invalidated beyond
the prefix its next owner reuses (``assign``). Free slots are handed out least recently used first, so the
longest-idle cache is the one evicted. Capacity (blocks as accounting) is not shared: ``BlockManager`` is unchanged
but for where a sequence starts.
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass


@dataclass(frozen=True)
class PrefixHit:
    """The longest cached prefix of a sequence's tokens: ``num_tokens`` of them, valid in ``slot``."""

    slot: int | None  # None when nothing matched
    num_tokens: int
    hashes: tuple[bytes, ...]  # the matched blocks' hashes, in order


def chain_hashes(
    token_ids: list[int], block_size: int, num_blocks: int, version: int, adapter_name: str | None = None
) -> list[bytes]:
    """The hashes of the first ``num_blocks`` full blocks of ``token_ids``, chained from the adapter's seed."""
    return _extend([], token_ids, block_size, num_blocks, _seed(version, adapter_name))


def _extend(chain: list[bytes], token_ids: list[int], block_size: int, num_blocks: int, seed: bytes) -> list[bytes]:
    """``chain`` (the hashes of the first blocks) extended in place to ``num_blocks`` hashes."""
    for i in range(len(chain), num_blocks):
        chain.append(_block_hash(chain[-1] if chain else seed, token_ids[i * block_size : (i + 1) * block_size]))
    return chain


def _seed(version: int, adapter_name: str | None) -> bytes:
    """The chain's seed for blocks computed under adapter ``adapter_name`` (None: the shared one) at ``version``:
    the version alone for the shared adapter and for the base model (version 0, any name), as before names
    existed; a named adapter's name after it (8 bytes and more: never another's seed)."""
    seed = version.to_bytes(8, "little")
    return seed if version == 0 or adapter_name is None else seed + b"\0" + adapter_name.encode()


def _block_hash(prev: bytes, block: list[int]) -> bytes:
    return hashlib.sha256(prev + array("q", block).tobytes()).digest()


class PrefixCache:
    def __init__(self, num_slots: int, block_size: int) -> None:
        self.block_size = block_size
        self._chains: list[list[bytes]] = [[] for _ in range(num_slots)]  # per slot: valid blocks' hashes
        self._index: dict[bytes, set[int]] = {}  # hash -> slots holding that block at its chain position
        self._frozen: set[int] = set()  # slots whose sequence's keys/values now mix adapter versions
        self._last_used = [0] * num_slots  # a tick per slot, for LRU among free slots
        self._tick = 0
        self.num_queries = 0  # tokens of sequences looked up (vLLM's prefix_cache_queries)
        self.num_hits = 0  # of those, tokens served from the cache (vLLM's prefix_cache_hits)

    def num_cached_blocks(self, slot: int) -> int:
        return len(self._chains[slot])

    def match(
        self, token_ids: list[int], version: int, free_slots: set[int], adapter_name: str | None = None
    ) -> PrefixHit:
        """The longest run of ``token_ids``' full blocks cached under adapter ``adapter_name`` at ``version``,
        leaving at least one token to compute (the last one's logits are needed); among slots holding it, a free
        one if any (no copy)."""
        max_blocks = (len(token_ids) - 1) // self.block_size
        bs = self.block_size
        seed = _seed(version, adapter_name)
        hashes: list[bytes] = []
        slots: set[int] = set()
        for i in range(max_blocks):  # hash by hash: the first miss ends the walk
            h = _block_hash(hashes[-1] if hashes else seed, token_ids[i * bs : (i + 1) * bs])
            holders = self._index.get(h)
            if not holders:
                break
            hashes.append(h)
            slots = holders
        if not hashes:
            return PrefixHit(None, 0, ())
        free = slots & free_slots
        # Taking a free slot invalidates its blocks beyond the match: take the one with fewest (then the most
        # recently used, the colder ones being evicted first anyway).
        slot = min(free, key=lambda s: (len(self._chains[s]), -self._last_used[s])) if free else min(slots)
        return PrefixHit(slot, len(hashes) * self.block_size, tuple(hashes))

    def pick_free(self, free_slots: set[int]) -> int:
        """The free slot to give a sequence without a hit in it: one holding nothing cached (the lowest, which
        keeps live slots compact), else the least recently used one (LRU eviction)."""
        empty = [s for s in free_slots if not self._chains[s]]
        if empty:
            return min(empty)
        return min(free_slots, key=self._last_used.__getitem__)

    def assign(self, slot: int, hashes: tuple[bytes, ...]) -> None:
        """``slot`` goes to a new sequence whose keys/values there are valid for ``hashes`` (its reused prefix,
        already there or copied in before the next forward); the slot's other blocks are invalid from now on."""
        chain = self._chains[slot]
        for h in chain[len(hashes) :] if chain[: len(hashes)] == list(hashes) else chain:
            self._unindex(h, slot)
        self._chains[slot] = list(hashes)
        for h in hashes:
            self._index.setdefault(h, set()).add(slot)
        self._frozen.discard(slot)
        self._touch(slot)

    def register(
        self,
        slot: int,
        token_ids: list[int],
        num_computed: int,
        version: int,
        serving: int,
        adapter_name: str | None = None,
    ) -> None:
        """The sequence in ``slot``, prefilled under adapter ``adapter_name`` at ``version``, has ``num_computed``
        tokens' keys/values in place: its full blocks among them become cached. Once its adapter's version served
        (``serving``) differs from its own, its later keys/values mix versions, so nothing more of it is
        registered."""
        if slot in self._frozen:
            return
        if serving != version:
            self._frozen.add(slot)
            return
        chain = self._chains[slot]
        num_old, num_full = len(chain), num_computed // self.block_size
        if num_full <= num_old:
            return  # most steps: a decode token that completes no block
        for h in _extend(chain, token_ids, self.block_size, num_full, _seed(version, adapter_name))[num_old:]:
            self._index.setdefault(h, set()).add(slot)
        self._touch(slot)

    def release(self, slot: int) -> None:
        """The slot's sequence is gone (finished, aborted, preempted); its blocks stay cached."""
        self._touch(slot)

    def _touch(self, slot: int) -> None:
        self._tick += 1
        self._last_used[slot] = self._tick

    def _unindex(self, h: bytes, slot: int) -> None:
        holders = self._index.get(h)
        if holders is not None:
            holders.discard(slot)
            if not holders:
                del self._index[h]
