"""The host tier: block states, slot states, LRU, and bytes that survive the round trip."""

from __future__ import annotations

import pytest
import torch

from kvd.block import BlockState
from kvd.block_pool import HOST, BlockPool, BlockRemoved, BlockStored
from kvd.cache_manager import KVCacheManager, TierCopies
from kvd.common.layout import CacheLayout
from kvd.config import DaemonConfig
from kvd.daemon import Daemon
from kvd.host_tier import HostTier, SlotState
from kvd_api.daemon.v1 import daemon_pb2 as pb

BS = 4


def h(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8


# ------------------------------------------------------- the COPYING rule


def test_a_block_whose_outgoing_copy_is_running_is_never_handed_out():
    pool = BlockPool(4)
    block = pool.allocate(1)[0]
    pool.cache_blocks([block], [h(1)])
    pool.hold_for_copy(block)
    pool.release([block])  # its request is done with it; the copy is not
    assert block.state is BlockState.COPYING
    assert block not in list(pool.free_queue)
    others = pool.allocate(3)
    assert block not in others and pool.allocate(1) is None, "the copying block must not be handed out"
    pool.copy_finished(block)
    assert block.state is BlockState.FREE and block.block_hash == h(1)
    assert pool.allocate(1) == [block]  # now it may be reused (and its content evicted)
    assert block.block_hash is None


def test_a_copying_block_still_serves_hits_and_outlives_its_last_holder():
    pool = BlockPool(2)
    block = pool.allocate(1)[0]
    pool.cache_blocks([block], [h(1)])
    pool.hold_for_copy(block)
    assert pool.match_prefix([h(1)]) == [block]
    pool.touch([block])  # a hit while the copy runs
    pool.release([block])
    pool.release([block])
    assert block.state is BlockState.COPYING and block.ref_cnt == 1
    pool.copy_finished(block)
    assert block.state is BlockState.FREE


# ------------------------------------------------------------ host slots


def test_host_slots_go_writing_then_ready_and_evict_least_recently_used_unread_first():
    events = []
    host = HostTier(2, record=events.append)
    a, b = host.reserve(h(1)), host.reserve(h(2))
    assert a.state is SlotState.WRITING and h(1) not in host.cached, "a slot being written is not readable"
    assert host.reserve(h(1)) is None, "a hash on its way is not copied twice"
    assert host.reserve(h(3)) is None, "every slot is being written"
    host.written(a)
    host.written(b)
    assert events == [BlockStored((h(1),), HOST), BlockStored((h(2),), HOST)]
    host.begin_read([a])  # h(1) is being read, and is now the most recent
    c = host.reserve(h(3))
    assert c is b and events[-1] == BlockRemoved((h(2),), HOST)
    assert host.reserve(h(4)) is None, "the only READY slot is being read"
    host.end_read([a])
    host.written(c)
    assert host.reserve(h(4)) is a  # h(1) was least recently used


def test_clearing_refuses_while_copies_run():
    host = HostTier(2)
    slot = host.reserve(h(1))
    with pytest.raises(ValueError, match="being copied"):
        host.clear()
    host.written(slot)
    assert host.clear() == 1 and host.num_free == 2 and h(1) not in host.cached


# ------------------------------------------------------------ admission


def test_host_hits_are_cached_tokens_that_cost_no_budget_but_need_device_blocks():
    pool = BlockPool(8)
    host = HostTier(8)
    manager = KVCacheManager(pool, BS, host)
    tokens = list(range(13))  # 3 full blocks + 1 token
    first = manager.new_request("a", tokens)
    for slot_hash in first.block_hashes:
        host.written(host.reserve(slot_hash))
    request = manager.new_request("b", tokens)
    admitted = manager.admit(request, token_budget=1)
    assert admitted.num_cached_tokens == 12 and admitted.num_host_cached_tokens == 12
    assert admitted.num_scheduled_tokens == 1  # only the last token is computed
    assert len(request.blocks) == 4
    offloads, swap_ins = manager.take_copies()
    assert offloads == [] and [b for _, b in swap_ins] == request.blocks[:3]
    assert all(slot.readers == 1 for slot, _ in swap_ins)
    # The swapped-in blocks are device hits for the next request at once.
    assert pool.match_prefix(request.block_hashes) == request.blocks[:3]


def test_a_commit_offloads_only_new_content_and_holds_it_until_copied():
    pool = BlockPool(8)
    host = HostTier(8)
    manager = KVCacheManager(pool, BS, host)
    request = manager.new_request("a", list(range(9)))
    manager.admit(request, token_budget=16)
    manager.commit(request, 9)
    offloads = manager.take_copies().offloads
    assert [b for b, _ in offloads] == request.blocks[:2]
    manager.free(request)
    assert all(b.state is BlockState.COPYING for b, _ in offloads)
    twin = manager.new_request("b", list(range(9)))
    manager.admit(twin, token_budget=16)
    manager.commit(twin, 9)
    assert manager.take_copies() == TierCopies(offloads=[], swap_ins=[]), "hits are not copied again"


# ------------------------------------------------- bytes, through a daemon


LAYOUT = CacheLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_size=BS, dtype="float32")


@pytest.fixture
def daemon(tmp_path):
    d = Daemon(DaemonConfig(block_size=BS, num_blocks=4, shm_dir=str(tmp_path), model_layout=LAYOUT, host_num_blocks=8))
    yield d
    d.close()


def run(daemon, session, new=None, done=None, finished=()):
    """One Step: ``new`` (id, prompt) arrives, ``done`` (id, computed) commits, ``finished`` are released."""
    msg = pb.StepRequest(finished=finished, settings=pb.SessionSettings(max_num_seqs=8, token_budget=64))
    if new is not None:
        msg.new_requests.add(request_id=new[0], prompt_token_ids=new[1], max_new_tokens=1)
    if done is not None:
        msg.commits.request_ids.append(done[0])
        msg.commits.num_computed_tokens.append(done[1])
        msg.commits.num_new_tokens.append(0)
    return daemon.step(session.session_id, msg)


def block_ids(reply) -> list[int]:
    return list(reply.scheduled.new_block_ids)


def test_evicted_blocks_come_back_from_the_host_with_their_bytes(daemon):
    session, memory = daemon.attach("test", None)
    cache = memory.tensor
    doc = list(range(100, 108))  # two full blocks
    out = run(daemon, session, new=("a", doc + [1]))
    for i, block_id in enumerate(block_ids(out)[:2]):  # the engine writes the K/V
        cache[block_id].fill_(float(i + 1))
    run(daemon, session, done=("a", 9), finished=["a"])
    assert daemon.wait_for_copies()
    assert daemon.stats().num_host_cached_blocks == 2 and daemon.stats().num_copying_blocks == 0
    # Another prompt takes every device block: the document is evicted there.
    other = list(range(200, 216))
    out = run(daemon, session, new=("b", other))
    for block_id in block_ids(out):
        cache[block_id].fill_(-1.0)
    run(daemon, session, done=("b", 16), finished=["b"])
    assert daemon.wait_for_copies()
    # The document again: served by the host tier, its bytes copied back.
    out = run(daemon, session, new=("c", doc + [2]))
    assert out.scheduled.num_cached_tokens[0] == 8 and out.scheduled.num_host_cached_tokens[0] == 8
    for i, block_id in enumerate(block_ids(out)[:2]):
        assert torch.equal(cache[block_id], torch.full_like(cache[block_id], float(i + 1)))
    run(daemon, session, finished=["c"])
    assert daemon.wait_for_copies()
    stats = daemon.stats()
    assert stats.host_hit_tokens == 8 and stats.bytes_from_host == 2 * LAYOUT.block_bytes
    assert stats.num_used_blocks == 0 and stats.num_copying_blocks == 0 and stats.num_host_blocks_read == 0


def test_a_prefix_may_alternate_between_tiers_block_by_block():
    """Device eviction is not prefix-ordered: block 0 may be gone from the
    device while block 1 is still there. Each block comes from where it is."""
    pool = BlockPool(8)
    host = HostTier(8)
    manager = KVCacheManager(pool, BS, host)
    first = manager.new_request("a", list(range(9)))
    manager.admit(first, token_budget=16)
    manager.commit(first, 9)
    offloads = manager.take_copies().offloads
    for block, slot in offloads:
        pool.copy_finished(block)
        host.written(slot)
    block0, block1 = first.blocks[:2]
    manager.free(first)
    pool.free_queue.remove(block0)  # evict block 0 only, as an allocation would
    pool.free_queue.appendleft(block0)
    assert pool.allocate(1) == [block0] and block0.block_hash is None
    again = manager.new_request("b", list(range(9)))
    admitted = manager.admit(again, token_budget=16)
    assert admitted.num_cached_tokens == 8 and admitted.num_host_cached_tokens == 4
    swap_ins = manager.take_copies().swap_ins
    assert [slot.block_hash for slot, _ in swap_ins] == [again.block_hashes[0]]
    assert again.blocks[1] is block1 and again.blocks[0] is swap_ins[0][1]
