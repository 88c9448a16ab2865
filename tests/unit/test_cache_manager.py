"""Request-level block operations: prefix-aware admission, chunked prefill, append, commit, free."""

from __future__ import annotations

import pytest

from kvd.block_pool import BlockPool
from kvd.cache_manager import DEFERRED, KVCacheManager
from kvd.common.hashing import encode_extra_keys, hash_token_ids

BS = 4


def make(num_blocks: int = 16, **pool_kwargs) -> tuple[BlockPool, KVCacheManager]:
    pool = BlockPool(num_blocks, **pool_kwargs)
    return pool, KVCacheManager(pool, BS)


def warm(manager: KVCacheManager, tokens: list[int], salt: bytes = b"", extra_keys=(), keep: bool = False):
    """Prefills ``tokens`` completely, commits them, and frees the request unless ``keep``."""
    request = manager.new_request("warm", tokens, salt, extra_keys)
    assert manager.admit(request, 10**6) is not None
    manager.commit(request, len(tokens))
    if not keep:
        manager.free(request)
    return request


def hashes(tokens: list[int], salt: bytes = b"") -> list[bytes]:
    return hash_token_ids(tokens, BS, encode_extra_keys(salt))


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def pool_state(pool: BlockPool):
    return (
        pool.num_free,
        [b.block_id for b in pool.free_queue],
        {k: v.block_id for k, v in pool.cached.items()},
        [(b.ref_cnt, b.block_hash) for b in pool.blocks],
        pool.num_evictions,
    )


def request_state(request):
    return (
        list(request.token_ids),
        list(request.block_hashes),
        ids(request.blocks),
        request.num_computed_tokens,
        request.num_scheduled_tokens,
        request.num_cached_tokens,
        request.num_indexed_blocks,
    )


PROMPT = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]


def test_block_size_must_be_positive():
    with pytest.raises(ValueError):
        KVCacheManager(BlockPool(4), 0)


# ---------------------------------------------------------------- new_request


def test_new_request_hashes_the_full_blocks_once():
    _, manager = make()
    request = manager.new_request("r", PROMPT[:10], b"s", [b"k"])
    assert request.block_hashes == hash_token_ids(PROMPT[:10], BS, encode_extra_keys(b"s", [b"k"]))
    assert len(request.block_hashes) == 2
    assert request.blocks == []


def test_empty_token_list_is_refused():
    _, manager = make()
    with pytest.raises(ValueError, match="empty"):
        manager.new_request("r", [])


@pytest.mark.parametrize("tokens", [[1, 2, 3, 4, 5, -1], [1, 2, -1], [1, 2, 3, 2**32], [1, 2.5]], ids=repr)
def test_bad_token_ids_anywhere_are_refused_including_the_partial_tail(tokens):
    _, manager = make()
    with pytest.raises(ValueError, match="token ids"):
        manager.new_request("r", tokens)


# ------------------------------------------------------------------ admission


def test_first_admission_computes_everything_and_allocates_blocks_for_it():
    pool, manager = make(16)
    request = manager.new_request("r", PROMPT[:10])
    admitted = manager.admit(request, 100)
    assert (admitted.num_cached_tokens, admitted.first_position, admitted.num_scheduled_tokens) == (0, 0, 10)
    assert ids(admitted.blocks) == [0, 1, 2]
    assert request.num_scheduled_tokens == 10
    assert request.num_computed_tokens == 0
    assert pool.num_free == 13


def test_block_aligned_full_prefix_hit_schedules_only_the_last_token():
    pool, manager = make(16)
    warmed = warm(manager, PROMPT[:8], keep=True)
    free_before = pool.num_free
    request = manager.new_request("r", PROMPT[:8])
    admitted = manager.admit(request, 100)
    assert admitted.num_cached_tokens == 8
    assert admitted.first_position == 7
    assert admitted.num_scheduled_tokens == 1
    assert ids(admitted.blocks) == ids(warmed.blocks)  # no new blocks
    assert pool.num_free == free_before
    assert [b.ref_cnt for b in admitted.blocks] == [2, 2]
    assert request.num_computed_tokens == 7
    assert request.num_scheduled_tokens == 8
    # Its logits give the next token; the next slot needs a fresh block.
    manager.commit(request, 8, [99])
    assert len(manager.append(request, 1)) == 1


def test_block_aligned_full_prefix_hit_on_free_cached_blocks_evicts_nothing():
    pool, manager = make(4)
    warm(manager, PROMPT[:8])
    request = manager.new_request("r", PROMPT[:8])
    admitted = manager.admit(request, 1)  # a budget of one token is enough
    assert (admitted.first_position, admitted.num_scheduled_tokens) == (7, 1)
    assert pool.num_free == 2
    assert pool.num_evictions == 0
    assert len(pool.cached) == 2


def test_unaligned_repeat_of_a_prompt_recomputes_only_its_partial_block():
    pool, manager = make(16)
    warm(manager, PROMPT[:10])
    request = manager.new_request("r", PROMPT[:10])
    admitted = manager.admit(request, 100)
    assert (admitted.num_cached_tokens, admitted.first_position, admitted.num_scheduled_tokens) == (8, 8, 2)
    assert len(admitted.blocks) == 3


@pytest.mark.parametrize(("budget", "scheduled"), [(8, 8), (100, 8), (3, 3), (1, 1)])
def test_partial_hit_budget_counts_only_uncached_tokens(budget, scheduled):
    _, manager = make(16)
    warm(manager, PROMPT[:8])
    request = manager.new_request("r", PROMPT[:16])
    admitted = manager.admit(request, budget)
    assert admitted.num_cached_tokens == 8
    assert admitted.first_position == 8
    assert admitted.num_scheduled_tokens == scheduled
    assert len(request.blocks) == 2 + -(-scheduled // BS)


def test_zero_budget_admits_nothing():
    pool, manager = make(16)
    request = manager.new_request("r", PROMPT)
    assert manager.admit(request, 0) is None
    assert request.blocks == []
    assert pool.num_free == 16


def test_admission_counts_only_the_blocks_still_needed():
    # 5 blocks; a running request holds 3 of them with the same 12-token prefix.
    pool, manager = make(5)
    warm(manager, PROMPT[:12], keep=True)
    assert pool.num_free == 2
    request = manager.new_request("r", PROMPT[:12] + [50, 51, 52, 53, 54, 55, 56, 57])  # 5 blocks in all
    admitted = manager.admit(request, 100)
    assert admitted is not None
    assert admitted.num_cached_tokens == 12
    assert len(admitted.blocks) == 5
    assert pool.num_free == 0


def test_admission_that_needs_one_block_too_many_waits_and_changes_nothing():
    pool, manager = make(5)
    warm(manager, PROMPT[:12], keep=True)
    before = pool_state(pool)
    request = manager.new_request("r", PROMPT[:12] + list(range(50, 59)))  # 3 new blocks, 2 free
    untouched = request_state(request)
    assert manager.admit(request, 100) is None
    assert pool_state(pool) == before
    assert request_state(request) == untouched
    assert (manager.query_tokens, manager.hit_tokens) == (12, 0)


def test_a_free_cached_hit_counts_against_free_capacity():
    # 4 blocks, 3 of them free and cached; 3 hits + 2 new blocks = 5 > 4.
    pool, manager = make(4)
    warm(manager, PROMPT[:12])
    assert pool.num_free == 4
    before = pool_state(pool)
    too_big = manager.new_request("big", PROMPT[:12] + list(range(50, 58)))
    assert manager.admit(too_big, 100) is None
    assert pool_state(pool) == before
    # 3 hits + 1 new block = 4 fits, and the hits are not evicted to make room.
    fits = manager.new_request("fits", PROMPT[:12] + list(range(50, 54)))
    admitted = manager.admit(fits, 100)
    assert admitted.num_cached_tokens == 12
    assert pool.num_evictions == 0
    assert len(pool.cached) == 3
    assert pool.num_free == 0


def test_chunked_prefill_allocates_only_for_the_scheduled_chunk():
    pool, manager = make(16)
    request = manager.new_request("r", list(range(10)))
    admitted = manager.admit(request, 6)
    assert (admitted.first_position, admitted.num_scheduled_tokens) == (0, 6)
    assert len(request.blocks) == 2
    assert pool.num_free == 14
    manager.commit(request, 6)
    assert len(manager.append(request, 2)) == 0  # positions 6, 7 fit block 1
    manager.commit(request, 8)
    assert len(manager.append(request, 2)) == 1  # positions 8, 9 need block 2
    assert request.num_scheduled_tokens == 10
    assert len(request.blocks) == 3
    assert pool.num_free == 13


def test_chunked_prefill_with_a_partial_hit_allocates_for_the_chunk_after_the_hit():
    pool, manager = make(16)
    warm(manager, PROMPT[:4])
    request = manager.new_request("r", PROMPT[:16])
    admitted = manager.admit(request, 5)
    assert (admitted.num_cached_tokens, admitted.first_position, admitted.num_scheduled_tokens) == (4, 4, 5)
    assert len(request.blocks) == 3  # 1 hit + blocks for positions 4..8


# ---------------------------------------------------------------------- append


def test_append_when_short_returns_none_and_changes_nothing():
    pool, manager = make(2)
    request = manager.new_request("r", list(range(8)))
    manager.admit(request, 100)
    before, req_before = pool_state(pool), request_state(request)
    assert manager.append(request, 1) is None
    assert pool_state(pool) == before
    assert request_state(request) == req_before


@pytest.mark.parametrize("num_tokens", [0, -1])
def test_append_of_no_tokens_is_refused(num_tokens):
    pool, manager = make(4)
    request = manager.new_request("r", list(range(6)))
    manager.admit(request, 100)
    before = request_state(request), pool_state(pool)
    with pytest.raises(ValueError):
        manager.append(request, num_tokens)
    assert (request_state(request), pool_state(pool)) == before


# ---------------------------------------------------------------------- commit


def test_commit_caches_only_computed_full_blocks():
    pool, manager = make(16)
    request = manager.new_request("r", PROMPT[:10])
    manager.admit(request, 100)
    manager.commit(request, 6)
    assert manager.device_cached_tokens(hashes(PROMPT[:10])) == 4
    assert request.blocks[0].block_hash is not None
    assert request.blocks[1].block_hash is None
    manager.commit(request, 10)
    assert manager.device_cached_tokens(hashes(PROMPT[:10])) == 8
    assert request.blocks[2].block_hash is None  # the partial block is never cached


def test_decode_tokens_that_fill_a_block_are_cached_and_hit_later():
    pool, manager = make(16)
    request = manager.new_request("r", [1, 2, 3, 4, 5, 6])
    manager.admit(request, 100)
    manager.commit(request, 6, [7])
    for position, sampled in ((6, 8), (7, 9)):
        manager.append(request, 1)
        manager.commit(request, position + 1, [sampled])
    assert list(request.token_ids) == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert request.blocks[1].block_hash == hashes([1, 2, 3, 4, 5, 6, 7, 8])[1]
    assert manager.device_cached_tokens(hashes([1, 2, 3, 4, 5, 6, 7, 8, 42])) == 8
    later = manager.new_request("later", [1, 2, 3, 4, 5, 6, 7, 8, 42])
    admitted = manager.admit(later, 100)
    assert admitted.num_cached_tokens == 8
    assert ids(admitted.blocks[:2]) == ids(request.blocks[:2])


def test_commit_going_backwards_is_refused():
    _, manager = make()
    request = manager.new_request("r", PROMPT[:10])
    manager.admit(request, 100)
    manager.commit(request, 8)
    before = request_state(request)
    with pytest.raises(ValueError, match="goes back"):
        manager.commit(request, 7)
    assert request_state(request) == before


def test_commit_beyond_the_scheduled_slots_is_refused():
    _, manager = make()
    request = manager.new_request("r", PROMPT[:10])
    manager.admit(request, 6)
    before = request_state(request)
    with pytest.raises(ValueError, match="slots"):
        manager.commit(request, 7)
    assert request_state(request) == before


def test_commit_beyond_the_known_tokens_is_refused():
    _, manager = make()
    request = manager.new_request("r", PROMPT[:6])
    manager.admit(request, 100)
    manager.append(request, 2)  # slots for positions 6, 7; only token 6 will be known
    before = request_state(request)
    with pytest.raises(ValueError, match="known"):
        manager.commit(request, 8, [1])
    assert request_state(request) == before
    manager.commit(request, 8, [1, 2])
    assert request.num_computed_tokens == 8


def test_commit_with_bad_new_token_ids_changes_nothing():
    pool, manager = make()
    request = manager.new_request("r", PROMPT[:8])
    manager.admit(request, 100)
    before = request_state(request), pool_state(pool)
    with pytest.raises(ValueError, match="token ids"):
        manager.commit(request, 8, [5, -3])
    assert (request_state(request), pool_state(pool)) == before


# ------------------------------------------------------------------ isolation


def test_another_cache_salt_gets_no_cached_tokens():
    _, manager = make(16)
    warm(manager, PROMPT[:12], salt=b"tenant-a")
    assert manager.device_cached_tokens(hashes(PROMPT[:12], b"tenant-a")) == 12
    assert manager.device_cached_tokens(hashes(PROMPT[:12], b"tenant-b")) == 0
    assert manager.device_cached_tokens(hashes(PROMPT[:12])) == 0
    other = manager.new_request("b", PROMPT[:12], b"tenant-b")
    assert manager.admit(other, 100).num_cached_tokens == 0
    same = manager.new_request("a", PROMPT[:12], b"tenant-a")
    assert manager.admit(same, 100).num_cached_tokens == 12


def test_other_extra_keys_get_no_cached_tokens():
    _, manager = make(16)
    warm(manager, PROMPT[:8], salt=b"s", extra_keys=[b"adapter-1"])
    other = manager.new_request("r", PROMPT[:8], b"s", [b"adapter-2"])
    assert manager.admit(other, 100).num_cached_tokens == 0


def test_lookup_changes_nothing():
    pool, manager = make(8)
    warm(manager, PROMPT[:8])
    before = pool_state(pool)
    assert manager.device_cached_tokens(hashes(PROMPT)) == 8
    assert pool_state(pool) == before


def test_with_caching_disabled_repeats_get_no_hits():
    pool, manager = make(8, enable_caching=False)
    warm(manager, PROMPT[:8])
    request = manager.new_request("r", PROMPT[:8])
    assert manager.admit(request, 100).num_cached_tokens == 0
    assert pool.cached == {}


def test_a_request_waits_for_a_prefix_another_is_computing_then_hits_it():
    pool, manager = make(8)
    first = manager.new_request("a", PROMPT[:10])
    second = manager.new_request("b", PROMPT[:8] + [77, 78])
    assert manager.admit(first, 4) is not None  # a chunk: block 0 of 2 full ones
    assert manager.admit(second, 100) is DEFERRED  # its block 0 is being computed
    manager.commit(first, 4)
    assert manager.admit(second, 100) is DEFERRED  # block 0 is cached, block 1 still in flight
    assert manager.append(first, 6) is not None
    manager.commit(first, 10)
    admitted = manager.admit(second, 100)
    assert admitted.num_cached_tokens == 8 and admitted.blocks[:2] == first.blocks[:2]
    manager.free(first)
    manager.free(second)
    assert manager.inflight == {} and pool.num_free == 8


def test_a_freed_request_stops_deferring_others():
    _, manager = make(8)
    first = manager.new_request("a", PROMPT[:8])
    second = manager.new_request("b", PROMPT[:8])
    manager.admit(first, 100)
    assert manager.admit(second, 100) is DEFERRED
    manager.free(first)  # preempted or cancelled before committing
    assert manager.admit(second, 100).num_cached_tokens == 0


def test_two_requests_computing_the_same_blocks_share_the_first_copy():
    pool, manager = make(8)
    first = manager.new_request("a", PROMPT[:4])
    second = manager.new_request("b", PROMPT[:4])
    manager.admit(first, 100)
    manager.commit(first, 4)
    manager.admit(second, 100)  # hits block 0, recomputes the last prompt token
    manager.append(first, 4)
    manager.append(second, 4)
    # Both sample the same four tokens: their block 1 has the same content.
    manager.commit(first, 8, [9, 9, 9, 9])
    manager.commit(second, 8, [9, 9, 9, 9])
    assert second.blocks[1].block_hash is None and first.blocks[1].block_hash is not None
    duplicate = second.blocks[1].block_id
    manager.free(first)
    manager.free(second)
    # The unhashed duplicate is reused before the cached copies.
    assert [b.block_id for b in pool.free_queue][0] == duplicate
    assert manager.device_cached_tokens(hashes(PROMPT[:4] + [9, 9, 9, 9])) == 8


# ------------------------------------------------------------------------ free


def test_free_returns_every_block_and_resets_the_request():
    pool, manager = make(8)
    request = manager.new_request("r", PROMPT[:10])
    manager.admit(request, 100)
    manager.commit(request, 10)
    manager.free(request)
    assert pool.num_free == 8
    assert request.blocks == []
    assert (request.num_computed_tokens, request.num_scheduled_tokens, request.num_indexed_blocks) == (0, 0, 0)
    assert manager.device_cached_tokens(hashes(PROMPT[:10])) == 8


def test_a_request_takes_no_more_of_the_cache_than_its_limit_and_waits_for_no_block_past_it():
    pool, manager = make()
    warm(manager, PROMPT)  # all four blocks cached
    limited = manager.new_request("scored", PROMPT)
    limited.max_cached_blocks = 1  # its positions from 4 on are computed again, for their logits
    admitted = manager.admit(limited, 10**6)
    assert admitted is not None and admitted.num_cached_tokens == BS and admitted.first_position == BS
    manager.commit(limited, len(PROMPT))
    # Its recomputed blocks are duplicates: the first copies stay the ones indexed.
    assert [b.block_hash for b in limited.blocks[1:]] == [None, None, None]
    other = manager.new_request("other", PROMPT[:8] + [99] * 8)
    other.max_cached_blocks = 0
    in_flight = manager.new_request("first", [50 + t for t in PROMPT])
    assert manager.admit(in_flight, 4) is not None  # its first block is being computed
    behind = manager.new_request("behind", [50 + t for t in PROMPT])
    behind.max_cached_blocks = 0
    assert manager.admit(behind, 10**6) not in (None, DEFERRED)  # it could not reuse that block: no wait
    assert manager.admit(other, 10**6).num_cached_tokens == 0
