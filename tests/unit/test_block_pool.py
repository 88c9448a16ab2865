"""The block pool: allocation, eviction order, touch/release, caching, reset and events."""

from __future__ import annotations

import hashlib

import pytest

from kvd.block_pool import AllCleared, BlockPool, BlockRemoved, BlockStored


def h(name: str) -> bytes:
    return hashlib.sha256(name.encode()).digest()


def queue_ids(pool: BlockPool) -> list[int]:
    return [block.block_id for block in pool.free_queue]


def cache(pool: BlockPool, blocks, names: list[str]) -> list[bytes]:
    hashes = [h(n) for n in names]
    pool.cache_blocks(blocks, hashes)
    return hashes


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError):
        BlockPool(0)


def test_new_pool_has_every_block_free_in_id_order():
    pool = BlockPool(5)
    assert pool.num_free == 5
    assert queue_ids(pool) == [0, 1, 2, 3, 4]
    assert pool.cached == {}
    assert all(b.ref_cnt == 0 and b.block_hash is None for b in pool.blocks)


# --------------------------------------------------------------- allocation


def test_allocate_pops_from_the_head_with_one_reference_each():
    pool = BlockPool(5)
    blocks = pool.allocate(2)
    assert [b.block_id for b in blocks] == [0, 1]
    assert all(b.ref_cnt == 1 for b in blocks)
    assert queue_ids(pool) == [2, 3, 4]
    assert pool.num_free == 3


def test_allocate_zero_returns_an_empty_list():
    pool = BlockPool(2)
    assert pool.allocate(0) == []
    assert pool.num_free == 2


def test_allocate_more_than_free_returns_none_and_changes_nothing():
    pool = BlockPool(4, record_events=True)
    held = pool.allocate(1)
    cache(pool, held, ["a"])
    pool.release(held)
    pool.take_events()
    before = queue_ids(pool)
    assert pool.allocate(5) is None
    assert queue_ids(pool) == before
    assert pool.num_free == 4
    assert h("a") in pool.cached
    assert pool.num_evictions == 0
    assert pool.take_events() == []


def test_allocate_negative_is_refused_and_changes_nothing():
    pool = BlockPool(4)
    with pytest.raises(ValueError):
        pool.allocate(-1)
    assert pool.num_free == 4


# ------------------------------------------------------------------ eviction


def test_allocating_a_free_cached_block_evicts_it():
    pool = BlockPool(2, record_events=True)
    blocks = pool.allocate(2)
    hashes = cache(pool, blocks, ["a", "b"])
    assert pool.take_events() == [BlockStored(tuple(hashes))]
    pool.release(blocks)
    # Released in reverse: b's block (1) at the tail side first, then a's (0).
    assert queue_ids(pool) == [1, 0]
    (reused,) = pool.allocate(1)
    assert reused.block_id == 1
    assert reused.block_hash is None
    assert h("b") not in pool.cached
    assert pool.cached == {h("a"): blocks[0]}
    assert pool.num_evictions == 1
    assert pool.take_events() == [BlockRemoved((h("b"),))]


def test_one_allocation_evicting_several_blocks_emits_one_event():
    pool = BlockPool(3, record_events=True)
    blocks = pool.allocate(3)
    cache(pool, blocks, ["a", "b", "c"])
    pool.release(blocks)
    pool.take_events()
    pool.allocate(2)
    assert pool.num_evictions == 2
    assert pool.take_events() == [BlockRemoved((h("c"), h("b")))]


def test_no_events_are_kept_unless_recording():
    pool = BlockPool(2)
    blocks = pool.allocate(2)
    cache(pool, blocks, ["a", "b"])
    pool.release(blocks)
    pool.release(pool.allocate(2))
    pool.reset()
    assert pool.num_evictions == 2
    assert pool.take_events() == []


def test_take_events_drains():
    pool = BlockPool(1, record_events=True)
    cache(pool, pool.allocate(1), ["a"])
    assert len(pool.take_events()) == 1
    assert pool.take_events() == []


# ---------------------------------------------------------------- touch/hits


def test_match_prefix_stops_at_the_first_miss_and_changes_nothing():
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    cache(pool, blocks, ["a", "b", "c"])
    pool.release(blocks)
    before = [b.ref_cnt for b in pool.blocks], queue_ids(pool)
    assert pool.match_prefix([h("a"), h("b"), h("x"), h("c")]) == blocks[:2]
    assert pool.match_prefix([h("b")]) == [blocks[1]]
    assert pool.match_prefix([h("x"), h("a")]) == []
    assert ([b.ref_cnt for b in pool.blocks], queue_ids(pool)) == before


def test_touch_takes_a_free_cached_block_out_of_the_queue():
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    cache(pool, blocks, ["a", "b"])
    pool.release(blocks)
    assert queue_ids(pool) == [2, 3, 1, 0]
    pool.touch([blocks[1]])
    assert blocks[1].ref_cnt == 1
    assert queue_ids(pool) == [2, 3, 0]
    assert pool.num_free == 3
    # Nothing can evict it now.
    pool.allocate(3)
    assert pool.cached == {h("b"): blocks[1]}


def test_touch_of_a_held_block_only_adds_a_reference():
    pool = BlockPool(3)
    (block,) = pool.allocate(1)
    pool.touch([block])
    assert block.ref_cnt == 2
    assert pool.num_free == 2
    pool.release([block])
    assert block.ref_cnt == 1
    assert pool.num_free == 2
    pool.release([block])
    assert pool.num_free == 3


# ------------------------------------------------------------------- release


def test_release_appends_hashed_blocks_to_the_tail_in_reverse():
    pool = BlockPool(6)
    table = pool.allocate(3)  # blocks 0, 1, 2
    cache(pool, table, ["a", "b", "c"])
    pool.release(table)
    # The request's last block sits nearest the head: it is evicted first.
    assert queue_ids(pool) == [3, 4, 5, 2, 1, 0]


def test_release_puts_unhashed_blocks_at_the_head():
    pool = BlockPool(6)
    table = pool.allocate(4)  # blocks 0..3; 0 and 1 hashed, 2 and 3 empty
    cache(pool, table[:2], ["a", "b"])
    pool.release(table)
    assert queue_ids(pool)[:2] == [2, 3]  # reused before anything cached
    assert queue_ids(pool)[-2:] == [1, 0]
    assert queue_ids(pool) == [2, 3, 4, 5, 1, 0]
    # The next allocations take the empty blocks and evict nothing.
    pool.allocate(4)
    assert pool.num_evictions == 0
    assert set(pool.cached) == {h("a"), h("b")}


def test_release_of_a_block_still_held_elsewhere_keeps_it_out_of_the_queue():
    pool = BlockPool(3)
    blocks = pool.allocate(2)
    pool.touch(blocks[:1])  # a second holder of block 0
    pool.release(blocks)
    assert blocks[0].ref_cnt == 1
    assert 0 not in queue_ids(pool)
    assert pool.num_free == 2


def test_releasing_more_often_than_taken_is_refused():
    pool = BlockPool(2)
    blocks = pool.allocate(1)
    pool.release(blocks)
    with pytest.raises(AssertionError):
        pool.release(blocks)
    assert pool.num_free == 2
    assert blocks[0].ref_cnt == 0


def test_lru_the_request_freed_first_is_evicted_first():
    pool = BlockPool(4)
    older = pool.allocate(2)
    newer = pool.allocate(2)
    cache(pool, older, ["o1", "o2"])
    cache(pool, newer, ["n1", "n2"])
    pool.release(older)
    pool.release(newer)
    pool.allocate(2)
    assert set(pool.cached) == {h("n1"), h("n2")}
    pool.allocate(1)
    assert set(pool.cached) == {h("n1")}  # the newer request's last block went first


def test_a_hit_refreshes_a_block_in_lru_order():
    pool = BlockPool(4)
    older = pool.allocate(2)
    newer = pool.allocate(2)
    cache(pool, older, ["o1", "o2"])
    cache(pool, newer, ["n1", "n2"])
    pool.release(older)
    pool.release(newer)
    hit = pool.match_prefix([h("o1")])
    pool.touch(hit)  # another request reuses the older prefix
    pool.release(hit)
    pool.allocate(3)
    assert set(pool.cached) == {h("o1")}


# ------------------------------------------------------------------- caching


def test_cache_blocks_indexes_each_block_under_its_hash():
    pool = BlockPool(3, record_events=True)
    blocks = pool.allocate(2)
    hashes = cache(pool, blocks, ["a", "b"])
    assert pool.cached == {hashes[0]: blocks[0], hashes[1]: blocks[1]}
    assert [b.block_hash for b in blocks] == hashes
    assert pool.take_events() == [BlockStored(tuple(hashes))]


def test_cache_blocks_tolerates_a_duplicate_and_the_first_copy_keeps_serving():
    pool = BlockPool(4, record_events=True)
    first = pool.allocate(1)
    second = pool.allocate(1)
    cache(pool, first, ["a"])
    pool.take_events()
    cache(pool, second, ["a"])
    assert second[0].block_hash is None
    assert pool.cached == {h("a"): first[0]}
    assert pool.take_events() == []  # nothing new was stored
    assert pool.match_prefix([h("a")]) == first
    # The duplicate is reused like any empty block when freed.
    pool.release(second)
    assert queue_ids(pool)[0] == second[0].block_id


def test_recaching_a_block_under_its_own_hash_is_a_no_op():
    pool = BlockPool(2, record_events=True)
    blocks = pool.allocate(1)
    cache(pool, blocks, ["a"])
    pool.take_events()
    cache(pool, blocks, ["a"])
    assert pool.cached == {h("a"): blocks[0]}
    assert pool.take_events() == []


def test_recaching_a_block_under_another_hash_is_refused():
    pool = BlockPool(2)
    blocks = pool.allocate(1)
    cache(pool, blocks, ["a"])
    with pytest.raises(AssertionError):
        cache(pool, blocks, ["b"])
    assert pool.cached == {h("a"): blocks[0]}


def test_cache_blocks_needs_one_hash_per_block():
    pool = BlockPool(2)
    blocks = pool.allocate(2)
    with pytest.raises(ValueError):
        pool.cache_blocks(blocks, [h("a")])


def test_with_caching_disabled_nothing_is_ever_indexed():
    pool = BlockPool(2, enable_caching=False, record_events=True)
    blocks = pool.allocate(2)
    cache(pool, blocks, ["a", "b"])
    assert pool.cached == {}
    assert all(b.block_hash is None for b in blocks)
    assert pool.match_prefix([h("a")]) == []
    pool.release(blocks)
    pool.allocate(2)
    assert pool.num_evictions == 0
    assert pool.take_events() == []


# --------------------------------------------------------------------- reset


def test_reset_is_refused_while_a_block_is_referenced():
    pool = BlockPool(3, record_events=True)
    blocks = pool.allocate(2)
    cache(pool, blocks, ["a", "b"])
    pool.release(blocks[1:])
    pool.take_events()
    with pytest.raises(ValueError, match="in use"):
        pool.reset()
    assert set(pool.cached) == {h("a"), h("b")}
    assert blocks[1].block_hash == h("b")
    assert pool.take_events() == []


def test_reset_forgets_every_hash_and_emits_all_cleared():
    pool = BlockPool(3, record_events=True)
    blocks = pool.allocate(2)
    cache(pool, blocks, ["a", "b"])
    pool.release(blocks)
    pool.take_events()
    assert pool.reset() == 2
    assert pool.cached == {}
    assert all(b.block_hash is None for b in pool.blocks)
    assert pool.num_free == 3
    assert pool.take_events() == [AllCleared()]
    # Reused blocks are not counted as evictions afterwards.
    pool.allocate(3)
    assert pool.num_evictions == 0
