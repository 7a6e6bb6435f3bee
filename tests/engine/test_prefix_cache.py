"""The prefix cache on its own (no model): chained block hashes keyed by adapter name and version, longest match, slots
invalidated when reused, least recently used free slot first; the block manager's choice of slot with it; and, on
the tiny model, a multi-turn follow-up served from its previous turn's blocks (generated tokens included)."""

from __future__ import annotations

from alchemist.engine import SamplingParams
from alchemist.engine.block_manager import BlockManager
from alchemist.engine.prefix_cache import PrefixCache, chain_hashes
from tests.engine.helpers import random_prompts
from tests.engine.test_block_manager import make_seq

BS = 4
A = list(range(100, 120))  # 5 full blocks


def test_a_change_in_an_early_block_changes_every_later_hash():
    base = chain_hashes(A, BS, 5, version=0)
    early = chain_hashes([0, *A[1:]], BS, 5, version=0)
    late = chain_hashes([*A[:9], 0, *A[10:]], BS, 5, version=0)  # block 2 changed
    assert len(set(base)) == 5
    assert all(a != b for a, b in zip(base, early, strict=True))
    assert base[:2] == late[:2] and all(a != b for a, b in zip(base[2:], late[2:], strict=True))


def test_longest_match_wins_and_one_token_is_left_to_compute():
    cache = PrefixCache(num_slots=3, block_size=BS)
    cache.register(0, A[:8] + [1] * 8, 16, version=0, serving=0)  # shares 2 blocks with A
    cache.register(1, A, 20, version=0, serving=0)
    hit = cache.match(A[:16] + [7, 7], version=0, free_slots={0, 1, 2})
    assert (hit.slot, hit.num_tokens) == (1, 16)
    hit = cache.match(A[:8] + [1] * 4 + [9], version=0, free_slots={0, 1, 2})
    assert (hit.slot, hit.num_tokens) == (0, 12)
    # A prompt of exactly 4 full blocks matches 3: its last token must be computed for its logits.
    assert cache.match(A[:16], version=0, free_slots={0, 1, 2}).num_tokens == 12
    assert cache.match([5] * 20, version=0, free_slots={0, 1, 2}).num_tokens == 0


def test_blocks_serve_only_the_adapter_version_they_were_computed_under():
    cache = PrefixCache(num_slots=2, block_size=BS)
    cache.register(0, A, 20, version=3, serving=3)
    assert cache.match(A + [1], version=4, free_slots={0, 1}).num_tokens == 0
    assert cache.match(A + [1], version=0, free_slots={0, 1}).num_tokens == 0
    assert cache.match(A + [1], version=3, free_slots={0, 1}).num_tokens == 20


def test_blocks_serve_only_the_adapter_name_they_were_computed_under():
    cache = PrefixCache(num_slots=3, block_size=BS)
    cache.register(0, A, 20, version=3, serving=3, adapter_name="team-a")
    cache.register(1, A[:8], 8, version=0, serving=0, adapter_name="base")
    assert cache.match(A + [1], version=3, free_slots={0, 1, 2}).num_tokens == 0  # the shared adapter's version 3
    assert cache.match(A + [1], version=3, free_slots={0, 1, 2}, adapter_name="team-b").num_tokens == 0
    assert cache.match(A + [1], version=3, free_slots={0, 1, 2}, adapter_name="team-a").num_tokens == 20
    # version 0 is the base model whatever the name: the shared adapter unset and "base" share their blocks
    assert cache.match(A, version=0, free_slots={0, 1, 2}).num_tokens == 8
    assert chain_hashes(A, BS, 2, version=2) != chain_hashes(A, BS, 2, version=2, adapter_name="")


def test_a_sequence_stops_registering_once_the_served_version_changes():
    cache = PrefixCache(num_slots=1, block_size=BS)
    cache.register(0, A, 8, version=1, serving=1)
    cache.register(0, A, 12, version=1, serving=2)  # computed under 2: its keys/values mix versions
    cache.register(0, A, 16, version=1, serving=1)  # back to 1 (a rollback): still mixed
    assert cache.num_cached_blocks(0) == 2
    assert cache.match(A, version=1, free_slots={0}).num_tokens == 8
    cache.assign(0, ())  # a new owner registers again
    cache.register(0, A, 16, version=1, serving=1)
    assert cache.num_cached_blocks(0) == 4


def test_a_reused_slot_keeps_only_the_prefix_its_new_owner_reuses():
    cache = PrefixCache(num_slots=2, block_size=BS)
    cache.register(0, A, 20, version=0, serving=0)
    hit = cache.match(A[:8] + [9, 9], version=0, free_slots={0, 1})
    assert (hit.slot, hit.num_tokens) == (0, 8)
    cache.assign(0, hit.hashes)  # the new sequence writes its own tokens after position 8
    assert cache.match(A, version=0, free_slots={1}).num_tokens == 8
    cache.assign(0, ())  # a sequence that reuses nothing
    assert cache.match(A, version=0, free_slots={1}).num_tokens == 0
    # A copy into another slot: both hold the prefix.
    cache.register(0, A, 20, version=0, serving=0)
    cache.assign(1, cache.match(A[:12] + [3], version=0, free_slots=set()).hashes)
    hit = cache.match(A[:12] + [3], version=0, free_slots={1})
    assert (hit.slot, hit.num_tokens) == (1, 12)  # the free holder: no copy needed


def test_free_slot_without_a_hit_is_an_empty_one_else_the_least_recently_used():
    cache = PrefixCache(num_slots=4, block_size=BS)
    for slot in (2, 0, 1):
        cache.register(slot, [slot] * 8, 8, version=0, serving=0)
    assert cache.pick_free({0, 1, 2, 3}) == 3  # holds nothing cached: evicts nothing
    assert cache.pick_free({0, 1, 2}) == 2  # registered first
    cache.release(2)  # its sequence just finished: recently used
    assert cache.pick_free({0, 1, 2}) == 0


def test_block_manager_takes_the_hit_slot_when_free_and_counts_tokens():
    bm = BlockManager(num_slots=3, num_blocks=30, block_size=BS, prefix_caching=True)
    first = make_seq("first", 20)
    first.admit(bm.allocate(first, 20, bm.lookup(first, 0)), 0.0)
    first.advance(20)
    bm.prefix_cache.register(first.slot, first.token_ids, 20, 0, 0)
    again = make_seq("again", 22)  # the same 1s, longer: 5 blocks cached
    hit = bm.lookup(again, 0)
    assert hit.slot == first.slot and hit.num_tokens == 20
    other = bm.allocate(again, 22, hit)  # first still runs there: another slot, to be copied into
    assert other != first.slot
    bm.free(first)
    later = make_seq("later", 22)
    hit = bm.lookup(later, 0)
    assert hit.num_tokens == 20 and bm.allocate(later, 22, hit) == first.slot  # free: taken as it is
    assert (bm.prefix_cache.num_queries, bm.prefix_cache.num_hits) == (20 + 22 + 22, 0 + 20 + 20)
    recorded = make_seq("recorded", 22)
    recorded.record = True
    assert bm.lookup(recorded, 0) is None  # computed whole


def test_follow_up_turn_hits_the_previous_reply_and_changes_no_token(make_engine):
    greedy = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    first, question = random_prompts([37, 6], seed=5)
    engines = {on: make_engine(block_size=4, enable_prefix_caching=on) for on in (True, False)}
    outputs = {}
    for on, engine in engines.items():
        reply = engine.generate([first], greedy)[0].output_token_ids
        follow_up = first + reply + question  # 63 tokens: the first turn's 56 computed hold 14 full blocks
        outputs[on] = reply, engine.generate([follow_up], greedy)[0].output_token_ids
    assert outputs[True] == outputs[False]
    stats = engines[True].stats()
    assert (stats.num_prefix_cache_queries, stats.num_prefix_cache_hits) == (37 + 63, 14 * 4)
    assert engines[False].stats().num_prefix_cache_queries == 0
