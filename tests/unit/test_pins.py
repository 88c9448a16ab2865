"""Pinned prefixes: held out of the free queue, capped in distinct blocks, idempotent by id."""

from __future__ import annotations

import pytest

from kvd.block_pool import BlockPool
from kvd.cache_manager import KVCacheManager
from kvd.common.hashing import encode_extra_keys, hash_token_ids
from kvd.errors import CapacityError, NotFoundError
from kvd.pins import PinRegistry

BS = 4
SYSTEM = [1, 2, 3, 4, 5, 6, 7, 8]  # two blocks
LONGER = SYSTEM + [9, 10, 11, 12]  # three blocks, sharing SYSTEM's two
OTHER = [50, 51, 52, 53, 54, 55, 56, 57]


def make(num_blocks: int = 8, cap: int = 4):
    pool = BlockPool(num_blocks)
    return pool, KVCacheManager(pool, BS), PinRegistry(pool, cap)


def warm(manager: KVCacheManager, tokens: list[int], keep: bool = False):
    request = manager.new_request("warm", tokens)
    assert manager.admit(request, 10**6) is not None
    manager.commit(request, len(tokens))
    if not keep:
        manager.free(request)
    return request


def hashes(tokens: list[int]) -> list[bytes]:
    return hash_token_ids(tokens, BS, encode_extra_keys())


def queue_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_queue]


def state(pool: BlockPool, pins: PinRegistry):
    return (
        queue_ids(pool),
        [b.ref_cnt for b in pool.blocks],
        {h: b.block_id for h, b in pool.cached.items()},
        {pid: [b.block_id for b in blocks] for pid, blocks in pins.pins.items()},
        pins.num_pinned_blocks,
    )


def test_bad_settings_are_refused():
    with pytest.raises(ValueError):
        PinRegistry(BlockPool(2), -1)
    _, _, pins = make()
    with pytest.raises(ValueError):
        pins.pin("", hashes(SYSTEM))


def test_pin_takes_a_reference_and_removes_blocks_from_the_free_queue():
    pool, manager, pins = make()
    warm(manager, SYSTEM)
    blocks = pins.pin("sys", hashes(SYSTEM))
    assert [b.block_hash for b in blocks] == hashes(SYSTEM)
    assert all(b.ref_cnt == 1 for b in blocks)
    assert not {b.block_id for b in blocks} & set(queue_ids(pool))
    assert pool.num_free == 6
    assert pins.num_pinned_blocks == 2


def test_pinned_blocks_survive_pressure_that_evicts_everything_else():
    pool, manager, pins = make(8)
    warm(manager, SYSTEM)
    warm(manager, OTHER)
    pins.pin("sys", hashes(SYSTEM))
    taken = pool.allocate(pool.num_free)
    assert len(taken) == 6
    assert manager.device_cached_tokens(hashes(OTHER)) == 0
    assert manager.device_cached_tokens(hashes(SYSTEM)) == 8
    assert pool.allocate(1) is None
    pool.release(taken)
    # Still there after the pressure is gone, and a request now hits them.
    request = manager.new_request("r", SYSTEM + [99])
    assert manager.admit(request, 100).num_cached_tokens == 8


def test_only_the_leading_cached_blocks_are_pinned():
    pool, manager, pins = make()
    warm(manager, SYSTEM)
    blocks = pins.pin("sys", hashes(LONGER + [13, 14, 15, 16]))
    assert len(blocks) == 2
    assert pins.num_pinned_blocks == 2


def test_pinning_an_uncached_prefix_pins_nothing():
    pool, manager, pins = make()
    before = state(pool, pins)
    assert pins.pin("cold", hashes(OTHER)) == []
    assert state(pool, pins)[:3] == before[:3]
    assert pins.num_pinned_blocks == 0


def test_a_pin_outlives_the_request_that_computed_its_blocks():
    pool, manager, pins = make()
    request = warm(manager, SYSTEM, keep=True)
    blocks = list(request.blocks)
    pins.pin("sys", hashes(SYSTEM))
    assert [b.ref_cnt for b in blocks] == [2, 2]
    manager.free(request)
    assert [b.ref_cnt for b in blocks] == [1, 1]
    assert not {b.block_id for b in blocks} & set(queue_ids(pool))


def test_pins_sharing_blocks_count_them_once_against_the_cap():
    pool, manager, pins = make(8, cap=3)
    warm(manager, LONGER)
    pins.pin("short", hashes(SYSTEM))
    pins.pin("long", hashes(LONGER))
    assert pins.num_pinned_blocks == 3
    shared = pool.match_prefix(hashes(SYSTEM))
    assert [b.ref_cnt for b in shared] == [2, 2]
    assert pool.match_prefix(hashes(LONGER))[2].ref_cnt == 1


def test_a_pin_over_the_cap_raises_and_changes_nothing():
    pool, manager, pins = make(8, cap=3)
    warm(manager, LONGER)
    warm(manager, OTHER)
    pins.pin("long", hashes(LONGER))
    before = state(pool, pins)
    with pytest.raises(CapacityError):
        pins.pin("other", hashes(OTHER))
    assert state(pool, pins) == before


def test_a_zero_cap_refuses_any_cached_block():
    pool, manager, pins = make(8, cap=0)
    warm(manager, SYSTEM)
    with pytest.raises(CapacityError):
        pins.pin("sys", hashes(SYSTEM))
    assert pins.pins == {}
    assert pool.num_free == 8


def test_re_pinning_the_same_id_and_prefix_is_idempotent_even_at_the_cap():
    pool, manager, pins = make(8, cap=2)
    warm(manager, SYSTEM)
    pins.pin("sys", hashes(SYSTEM))
    before = state(pool, pins)
    pins.pin("sys", hashes(SYSTEM))
    pins.pin("sys", hashes(SYSTEM))
    assert state(pool, pins) == before


def test_re_pinning_an_id_with_another_prefix_replaces_its_blocks_within_the_cap():
    pool, manager, pins = make(8, cap=2)
    warm(manager, SYSTEM)
    warm(manager, OTHER)
    old = pins.pin("p", hashes(SYSTEM))
    new = pins.pin("p", hashes(OTHER))  # 2 - 2 + 2 blocks: fits a cap of 2
    assert pins.num_pinned_blocks == 2
    assert [b.ref_cnt for b in old] == [0, 0]
    assert {b.block_id for b in old} <= set(queue_ids(pool))
    assert [b.ref_cnt for b in new] == [1, 1]
    assert manager.device_cached_tokens(hashes(SYSTEM)) == 8  # unpinned, still cached


def test_growing_a_pin_keeps_the_shared_blocks_out_of_the_free_queue():
    pool, manager, pins = make(8, cap=3)
    warm(manager, LONGER)
    pins.pin("p", hashes(SYSTEM))
    queue_before = queue_ids(pool)
    blocks = pins.pin("p", hashes(LONGER))
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]
    assert queue_ids(pool) == [i for i in queue_before if i != blocks[2].block_id]
    assert pins.num_pinned_blocks == 3


def test_unpin_returns_the_blocks_to_the_free_queue_still_cached():
    pool, manager, pins = make(8)
    warm(manager, SYSTEM)
    blocks = pins.pin("sys", hashes(SYSTEM))
    assert pins.unpin("sys") == 2
    assert pins.pins == {}
    assert pins.num_pinned_blocks == 0
    assert pool.num_free == 8
    assert all(b.ref_cnt == 0 for b in blocks)
    assert queue_ids(pool)[-2:] == [b.block_id for b in reversed(blocks)]  # hashed: to the tail
    assert manager.device_cached_tokens(hashes(SYSTEM)) == 8


def test_unpinning_one_of_two_sharing_pins_keeps_the_shared_blocks():
    pool, manager, pins = make(8, cap=3)
    warm(manager, LONGER)
    pins.pin("short", hashes(SYSTEM))
    pins.pin("long", hashes(LONGER))
    pins.unpin("long")
    assert pins.num_pinned_blocks == 2
    assert [b.ref_cnt for b in pool.match_prefix(hashes(LONGER))] == [1, 1, 0]


def test_unpin_of_an_unknown_pin_is_not_found():
    pool, manager, pins = make()
    with pytest.raises(NotFoundError):
        pins.unpin("nope")
    warm(manager, SYSTEM)
    pins.pin("sys", hashes(SYSTEM))
    pins.unpin("sys")
    with pytest.raises(NotFoundError):
        pins.unpin("sys")
    assert pool.num_free == 8


def test_reset_is_refused_while_a_pin_holds_blocks():
    pool, manager, pins = make()
    warm(manager, SYSTEM)
    pins.pin("sys", hashes(SYSTEM))
    with pytest.raises(ValueError):
        pool.reset()
    assert manager.device_cached_tokens(hashes(SYSTEM)) == 8
