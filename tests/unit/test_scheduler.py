"""The daemon's scheduling through run_step, on protobuf Steps: order, budget,
chunking, speculative slots for a forward in flight, preemption, fairness,
and atomic validation."""

from __future__ import annotations

from itertools import accumulate

import pytest

from kvd.block_pool import BlockPool
from kvd.cache_manager import KVCacheManager
from kvd.errors import NotFoundError
from kvd.scheduler import run_step
from kvd.session import Session, SessionRegistry
from kvd_api.daemon.v1 import daemon_pb2 as pb

BS = 4


def make(num_blocks: int = 16, token_budget: int = 1000, max_num_seqs: int = 64):
    pool = BlockPool(num_blocks, record_events=True)
    session = SessionRegistry(60).open("engine")
    session.token_budget, session.max_num_seqs = token_budget, max_num_seqs
    return pool, KVCacheManager(pool, BS), session


def new(request_id: str, tokens, max_new_tokens: int = 16, **kwargs) -> pb.NewRequest:
    return pb.NewRequest(request_id=request_id, prompt_token_ids=tokens, max_new_tokens=max_new_tokens, **kwargs)


def commits(*entries) -> pb.Commits:
    """entries: (request_id, num_computed_tokens[, new token ids])."""
    msg = pb.Commits()
    for request_id, computed, *sampled in entries:
        tokens = sampled[0] if sampled else []
        msg.request_ids.append(request_id)
        msg.num_computed_tokens.append(computed)
        msg.num_new_tokens.append(len(tokens))
        msg.new_token_ids.extend(tokens)
    return msg


def step(
    manager,
    session,
    *,
    new_requests=(),
    done=(),
    finished=(),
    in_flight=False,
    settings=None,
    block_cap=None,
    event=b"",
):
    msg = pb.StepRequest(
        new_requests=list(new_requests),
        commits=commits(*done),
        finished=list(finished),
        forward_in_flight=in_flight,
        forward_event=event,
    )
    if settings is not None:
        msg.settings.CopyFrom(settings)
    return run_step(manager, session, msg, block_cap)


def rows(reply: pb.StepResponse) -> list[tuple[str, int, int, int, list[int]]]:
    """(request id, first position, tokens, cached tokens, new block ids) per scheduled request."""
    s = reply.scheduled
    offsets = list(accumulate(s.num_new_blocks, initial=0))
    return [
        (
            rid,
            s.first_positions[i],
            s.num_tokens[i],
            s.num_cached_tokens[i],
            list(s.new_block_ids[offsets[i] : offsets[i + 1]]),
        )
        for i, rid in enumerate(s.request_ids)
    ]


def spans(reply) -> list[tuple[str, int, int]]:
    return [(rid, first, n) for rid, first, n, _, _ in rows(reply)]


def snapshot(pool: BlockPool, manager: KVCacheManager, session: Session):
    return (
        pool.num_free,
        [b.block_id for b in pool.free_queue],
        {h: b.block_id for h, b in pool.cached.items()},
        [(b.ref_cnt, b.block_hash) for b in pool.blocks],
        list(session.requests),
        list(session.running),
        [r.request_id for r in session.waiting],
        {
            rid: (
                list(r.token_ids),
                list(r.block_hashes),
                [b.block_id for b in r.blocks],
                r.num_computed_tokens,
                r.num_scheduled_tokens,
            )
            for rid, r in session.requests.items()
        },
        list(session.recently_freed),
        (session.max_num_seqs, session.token_budget, session.arrivals),
        (manager.query_tokens, manager.hit_tokens),
    )


# ----------------------------------------------------------- the happy path


def test_a_prompt_is_chunked_then_decodes_one_token_a_step():
    pool, manager, session = make(16, token_budget=6)
    reply = step(manager, session, new_requests=[new("a", list(range(10)))])
    assert rows(reply) == [("a", 0, 6, 0, [0, 1])]
    assert reply.num_free_blocks == pool.num_free == 14 and reply.num_waiting == 0
    reply = step(manager, session, done=[("a", 6)])
    assert rows(reply) == [("a", 6, 4, 0, [2])]
    reply = step(manager, session, done=[("a", 10, [10])])  # the prompt is in; one token sampled
    assert spans(reply) == [("a", 10, 1)]
    reply = step(manager, session, done=[("a", 11, [11])], finished=["a"])
    assert spans(reply) == [] and list(reply.released) == ["a"]
    assert reply.num_free_blocks == 16 and len(pool.cached) == 2


def test_the_prompt_crosses_once_and_is_hashed_once(monkeypatch):
    from kvd.common.hashing import BlockHasher

    calls = []
    real = BlockHasher.advance
    monkeypatch.setattr(BlockHasher, "advance", lambda *a: calls.append(1) or real(*a))
    _, manager, session = make(4)
    step(manager, session, new_requests=[new("a", list(range(16))), new("big", list(range(100, 140)))])
    for _ in range(5):  # "big" does not fit: it waits without being sent or hashed again
        reply = step(manager, session)
        assert reply.num_waiting == 1
    assert len(calls) == 2


def test_each_arrival_is_told_what_the_cache_held_of_its_prompt():
    _, manager, session = make(16, max_num_seqs=1)
    step(manager, session, new_requests=[new("a", list(range(12)))])
    step(manager, session, done=[("a", 12, [1])], finished=["a"])  # blocks 0-2 cached
    reply = step(manager, session, new_requests=[new("b", list(range(8)) + [99] * 6), new("c", [5] * 9)])
    assert list(reply.arrival_cached_tokens) == [8, 0]  # block-aligned, in new_requests' order
    assert rows(reply)[0][:4] == ("b", 8, 6, 8)  # admission finds what arrival saw
    assert list(step(manager, session).arrival_cached_tokens) == []  # no arrivals, no column


def test_a_full_prefix_hit_computes_only_the_last_token():
    pool, manager, session = make(16)
    step(manager, session, new_requests=[new("a", list(range(8)))])
    step(manager, session, done=[("a", 8, [1])], finished=["a"])
    reply = step(manager, session, new_requests=[new("b", list(range(8)))])
    assert rows(reply) == [("b", 7, 1, 8, [0, 1])]  # the whole table, all of it hits


def test_order_is_priority_then_arrival_under_one_budget():
    _, manager, session = make(16, token_budget=10)
    reply = step(
        manager,
        session,
        new_requests=[
            new("late", list(range(6)), priority=1),
            new("a", list(range(10, 16))),
            new("b", list(range(20, 26))),
        ],
    )
    assert spans(reply) == [("a", 0, 6), ("b", 0, 4)]
    assert reply.num_waiting == 1


def test_decodes_go_before_prefill_chunks_and_admissions():
    _, manager, session = make(32, token_budget=6)
    step(manager, session, new_requests=[new("long", list(range(20)))])  # first 6 of 20
    step(manager, session, done=[("long", 6)], new_requests=[new("short", [1, 2])])  # long 6 more
    reply = step(manager, session, done=[("long", 12)], new_requests=[new("new", [5, 6, 7])])
    assert spans(reply) == [("long", 12, 6)]
    reply = step(manager, session, done=[("long", 18)])
    assert spans(reply)[0] == ("long", 18, 2)


def test_max_num_seqs_caps_admissions_and_can_change():
    _, manager, session = make(32, max_num_seqs=1)
    reply = step(manager, session, new_requests=[new("a", [1]), new("b", [2])])
    assert [r[0] for r in spans(reply)] == ["a"] and reply.num_waiting == 1
    reply = step(manager, session, done=[("a", 1, [3])], settings=pb.SessionSettings(max_num_seqs=2, token_budget=64))
    assert [r[0] for r in spans(reply)] == ["a", "b"]


def test_max_new_tokens_caps_the_schedule():
    _, manager, session = make(16)
    step(
        manager,
        session,
        new_requests=[new("warm", [1, 2, 3, 4, 5], max_new_tokens=0), new("two", [9, 9], max_new_tokens=2)],
    )
    reply = step(manager, session, done=[("warm", 5), ("two", 2, [7])])
    assert spans(reply) == [("two", 2, 1)]  # the warm-up never decodes
    reply = step(manager, session, done=[("two", 3, [8])])
    assert spans(reply) == []  # its last token is never computed


# ----------------------------------------------------- a forward in flight


def test_a_forward_in_flight_gets_one_speculative_slot_per_sampling_request():
    _, manager, session = make(16, token_budget=8)
    step(manager, session, new_requests=[new("a", list(range(5))), new("p", list(range(20, 30)))])
    # Forward 1 runs: a (all 5 prompt tokens, samples) and p (3 of 10).
    reply = step(manager, session, in_flight=True)
    assert spans(reply) == [("a", 5, 1), ("p", 3, 7)]  # a: the slot for the token forward 1 samples
    # Forward 2 runs; forward 1's results arrive.
    reply = step(manager, session, done=[("a", 5, [50]), ("p", 3)], in_flight=True)
    assert spans(reply) == [("a", 6, 1), ("p", 10, 1)]
    # Never more than one slot ahead of what the daemon knows.
    reply = step(manager, session, in_flight=True)
    assert spans(reply) == []


def test_without_a_forward_in_flight_nothing_is_speculative():
    _, manager, session = make(16)
    step(manager, session, new_requests=[new("a", list(range(5)))])
    assert spans(step(manager, session)) == []
    assert spans(step(manager, session, done=[("a", 5, [7])])) == [("a", 5, 1)]


def test_a_late_commit_of_a_preempted_request_appends_its_token():
    pool, manager, session = make(4)
    step(manager, session, new_requests=[new("old", list(range(8))), new("new", list(range(100, 106)))])
    # Forward 1 (both prompts) runs; old's speculative slot needs a block: the newest goes.
    reply = step(manager, session, in_flight=True)
    assert list(reply.preempted) == ["new"] and spans(reply) == [("old", 8, 1)]
    # Forward 1's results arrive: new's sampled token is kept while it waits.
    reply = step(manager, session, done=[("old", 8, [8]), ("new", 6, [106])], in_flight=True)
    assert list(session.requests["new"].token_ids) == list(range(100, 107))
    assert "new" not in session.running and reply.num_waiting == 1


def test_cancelling_a_request_with_its_last_commit_frees_after_committing():
    pool, manager, session = make(16)
    step(manager, session, new_requests=[new("a", list(range(7)))])
    reply = step(manager, session, in_flight=True)
    reply = step(manager, session, done=[("a", 7, [7])], finished=["a"], in_flight=True)
    assert list(reply.released) == ["a"] and spans(reply) == []
    # Its full block was cached before the free; forward 2 still writes its
    # position 7, so that block stays fenced until the next Step.
    assert len(pool.cached) == 1 and pool.num_free == 15
    with pytest.raises(ValueError, match="already released"):
        step(manager, session, done=[("a", 8, [1])])
    step(manager, session)
    assert pool.num_free == 16


def test_a_waiting_request_can_be_cancelled():
    _, manager, session = make(2)
    step(manager, session, new_requests=[new("a", list(range(8))), new("b", list(range(20, 28)))])
    reply = step(manager, session, finished=["b"])
    assert list(reply.released) == ["b"] and reply.num_waiting == 0


# ---------------------------------------------------------------- preemption


def fill_pool_with_two_requests():
    """4 blocks: "old" holds 2 (8 tokens), "new" holds 2 (6 tokens); all committed."""
    pool, manager, session = make(4)
    step(manager, session, new_requests=[new("old", list(range(8))), new("new", list(range(100, 106)))])
    assert pool.num_free == 0
    return pool, manager, session


def test_the_last_in_schedule_order_is_preempted_and_waits_again():
    pool, manager, session = fill_pool_with_two_requests()
    reply = step(manager, session, done=[("old", 8, [8]), ("new", 6, [106])])
    assert list(reply.preempted) == ["new"]
    assert rows(reply)[0][:3] == ("old", 8, 1)
    assert list(session.running) == ["old"] and [r.request_id for r in session.waiting] == ["new"]
    # Once old is gone, new resumes, hitting its own committed block.
    reply = step(manager, session, done=[("old", 9, [9])], finished=["old"])
    ((rid, first, n, cached, _),) = rows(reply)
    assert (rid, cached, first, n) == ("new", 4, 4, 3)


def test_a_lower_priority_request_is_preempted_first():
    pool, manager, session = make(4)
    step(manager, session, new_requests=[new("low", list(range(8)), priority=5), new("high", list(range(100, 106)))])
    reply = step(manager, session, done=[("low", 8, [8]), ("high", 6, [106])])
    assert list(reply.preempted) == ["low"]


def test_a_request_that_is_itself_last_preempts_itself():
    pool, manager, session = make(4)
    step(
        manager, session, new_requests=[new("old", list(range(8)), max_new_tokens=0), new("new", list(range(100, 106)))]
    )
    before = [b.block_id for b in session.requests["old"].blocks]
    reply = step(manager, session, done=[("old", 8), ("new", 6, [106, 107, 108])])  # new wants a third block
    assert list(reply.preempted) == ["new"] and spans(reply) == []
    assert [b.block_id for b in session.requests["old"].blocks] == before and pool.num_free == 2


def test_a_step_that_preempted_admits_nobody():
    pool, manager, session = fill_pool_with_two_requests()
    reply = step(manager, session, done=[("old", 8, [8]), ("new", 6, [106])], new_requests=[new("tiny", [1])])
    assert list(reply.preempted) == ["new"]
    assert "tiny" not in session.running and reply.num_waiting == 2


# ----------------------------------------- the fence: a forward in flight


def two_sessions_on_a_full_pool():
    """4 blocks: session a runs "old" (8 tokens, 2 blocks) and "new" (6 tokens,
    2 blocks), both in forward 1, not committed yet; session b is empty."""
    registry = SessionRegistry(60)
    pool = BlockPool(4)
    manager = KVCacheManager(pool, BS)
    a, b = registry.open("a"), registry.open("b")
    step(manager, a, new_requests=[new("old", list(range(8))), new("new", list(range(100, 106)))])
    assert pool.num_free == 0
    return registry, pool, manager, a, b


def test_a_victim_of_a_forward_in_flight_is_fenced_from_other_sessions():
    registry, pool, manager, a, b = two_sessions_on_a_full_pool()
    new_blocks = [blk.block_id for blk in a.requests["new"].blocks]
    # Step 2 while forward 1 (writing both prompts) runs: old's speculative
    # slot needs a block, so new is preempted. Its blocks are still being
    # written: old (same engine, its forward 2 runs after forward 1) may take
    # one, the other stays fenced, out of the pool.
    reply = step(manager, a, in_flight=True)
    assert list(reply.preempted) == ["new"] and spans(reply) == [("old", 8, 1)]
    assert rows(reply)[0][4] == new_blocks[:1]
    assert [blk.block_id for blk in a.fenced] == new_blocks[1:] and pool.num_free == 0
    # Session b (another engine) asks now: nothing for it, forward 1 may still write.
    reply = step(manager, b, new_requests=[new("other", [7, 7, 7])])
    assert spans(reply) == [] and reply.num_waiting == 1
    # a's next Step comes after it read forward 1: the fence lifts.
    step(manager, a, done=[("old", 8, [8]), ("new", 6, [106])], in_flight=True)
    assert a.fenced == []
    reply = step(manager, b)
    assert [(rid, blocks) for rid, *_, blocks in rows(reply)] == [("other", new_blocks[1:])]


def test_only_the_blocks_a_forward_may_write_are_fenced():
    pool, manager, session = make(5)
    step(
        manager, session, new_requests=[new("done", list(range(8)), max_new_tokens=0), new("r", list(range(100, 106)))]
    )
    step(manager, session, done=[("done", 8), ("r", 6, [106])])  # forward 2 computes r's position 6
    cached, writing = session.requests["r"].blocks
    assert cached.block_hash is not None and writing.block_hash is None
    # r ends while forward 2 still writes its second block (a real engine waits;
    # the daemon does not rely on it): its committed, cached block is never
    # written again and goes back at once, the other is fenced.
    step(manager, session, finished=["r"], in_flight=True)
    assert cached.ref_cnt == 0 and cached.prev_free is not None
    assert session.fenced == [writing] and writing.ref_cnt == 1 and writing.prev_free is None


def test_a_step_without_a_forward_in_flight_fences_nothing():
    pool, manager, session = fill_pool_with_two_requests()
    reply = step(manager, session, done=[("old", 8, [8]), ("new", 6, [106])])
    assert list(reply.preempted) == ["new"] and session.fenced == [] and pool.num_free == 1  # old took one


def test_an_ended_session_gives_back_its_fenced_blocks():
    registry, pool, manager, a, b = two_sessions_on_a_full_pool()
    step(manager, a, in_flight=True)
    assert len(a.fenced) == 1
    assert registry.close(a.session_id, manager) == 2
    assert pool.num_free == 4 and a.fenced == []


def test_a_bad_step_keeps_the_fence():
    registry, pool, manager, a, b = two_sessions_on_a_full_pool()
    step(manager, a, in_flight=True)
    with pytest.raises(NotFoundError):
        step(manager, a, finished=["nobody"])
    assert len(a.fenced) == 1 and pool.num_free == 0


def test_giving_up_blocks_under_a_forward_makes_copies_wait_for_it_until_the_next_step():
    registry, pool, manager, a, b = two_sessions_on_a_full_pool()
    step(manager, a, in_flight=True, event=b"forward-1")  # preempts "new" while forward 1 runs
    assert registry.unsettled_forwards() == [b"forward-1"]
    step(manager, b, new_requests=[new("other", [7, 7, 7])])  # another session's Step: still unsettled
    assert registry.unsettled_forwards() == [b"forward-1"]
    step(manager, a, done=[("old", 8, [8]), ("new", 6, [106])], in_flight=True, event=b"forward-2")
    assert registry.unsettled_forwards() == []  # forward 1 is done; this Step gave nothing up


def test_a_finished_request_under_a_forward_unsettles_its_session_too():
    registry, pool, manager, a, b = two_sessions_on_a_full_pool()
    step(manager, a, finished=["old"], in_flight=True, event=b"forward-1")
    assert registry.unsettled_forwards() == [b"forward-1"]
    registry.close(a.session_id, manager)  # an engine detaches once its writes landed
    assert registry.unsettled_forwards() == []


def test_giving_up_blocks_with_no_forward_in_flight_or_no_event_unsettles_nothing():
    registry, pool, manager, a, b = two_sessions_on_a_full_pool()
    step(manager, a, finished=["old"], event=b"forward-1")  # nothing in flight: forward 1 was read
    step(manager, a, finished=["new"], in_flight=True)  # in flight, but no GPU event (CPU)
    assert registry.unsettled_forwards() == []


# ------------------------------------------------------------------ fairness


def test_a_session_over_its_share_stops_admitting_while_another_starves():
    registry = SessionRegistry(60)
    pool = BlockPool(8)
    manager = KVCacheManager(pool, BS)
    hog, meek = registry.open("hog"), registry.open("meek")

    def go(session, **kwargs):
        return step(manager, session, block_cap=registry.fair_share(session, pool.num_blocks), **kwargs)

    go(hog, new_requests=[new(f"h{i}", list(range(10 * i, 10 * i + 8))) for i in range(8)])  # 4 of them fit
    reply = go(meek, new_requests=[new("m", list(range(500, 508)))])
    assert reply.num_waiting == 1 and meek.starved
    # hog finishes one; its next admission is capped (it holds 6 > 8 / 2), so meek gets the room.
    reply = go(hog, done=[("h0", 8, [1])], finished=["h0"])
    assert "h4" not in hog.running
    reply = go(meek)
    assert spans(reply) == [("m", 0, 8)]


# ---------------------------------------------------------------- bad input


def baseline():
    """Running A, C; waiting W (does not fit); released F; and a good Step."""
    pool, manager, session = make(8)
    step(manager, session, new_requests=[new("A", list(range(10))), new("C", list(range(30, 35))), new("F", [9] * 5)])
    step(manager, session, done=[("A", 10, [100]), ("C", 5, [102]), ("F", 5, [1])], finished=["F"])
    step(manager, session, new_requests=[new("W", list(range(40, 80)))])
    good = dict(new_requests=[new("D", [1, 2])], done=[("A", 11, [103])], finished=["C"])
    return pool, manager, session, good


BAD = {
    "commit goes backwards": {"done": [("A", 4)]},
    "commit beyond slots": {"done": [("A", 13, [1, 2])]},
    "commit beyond known tokens": {"done": [("A", 12)]},
    "negative sampled token": {"done": [("A", 11, [-1])]},
    "too large sampled token": {"done": [("A", 11, [2**32])]},
    "commit of an unknown request": {"done": [("ghost", 1)]},
    "commit of a released request": {"done": [("F", 6)]},
    "the same request committed twice": {"done": [("A", 11, [103]), ("A", 11)]},
    "finished twice": {"finished": ["C", "C"]},
    "finished unknown": {"finished": ["ghost"]},
    "finished released": {"finished": ["F"]},
    "new request with no tokens": {"new_requests": [new("E", [])]},
    "new request with a bad token": {"new_requests": [new("E", [1, 2, 3, 4, -1])]},
    "new request with a huge token": {"new_requests": [new("E", [1, 2**32, 3, 4])]},
    "new request already running": {"new_requests": [new("A", [1])]},
    "new request already waiting": {"new_requests": [new("W", [1])]},
    "new request with an empty id": {"new_requests": [new("", [1])]},
    "new request twice": {"new_requests": [new("E", [1]), new("E", [2])]},
    "negative max_new_tokens": {"new_requests": [new("E", [1], max_new_tokens=-1)]},
    "zero token budget": {"settings": pb.SessionSettings(max_num_seqs=4, token_budget=0)},
    "zero max_num_seqs": {"settings": pb.SessionSettings(max_num_seqs=0, token_budget=4)},
}


@pytest.mark.parametrize("name", list(BAD))
def test_a_bad_step_is_refused_whole_and_changes_nothing(name):
    pool, manager, session, good = baseline()
    step(manager, session)  # the baseline's events are taken by a step
    pool.take_events()
    before = snapshot(pool, manager, session)
    bad = {**good, **{k: (good.get(k, []) + v if isinstance(v, list) else v) for k, v in BAD[name].items()}}
    with pytest.raises((ValueError, NotFoundError)):
        step(manager, session, **bad)
    assert snapshot(pool, manager, session) == before
    assert pool.take_events() == []


def test_the_baseline_step_is_good():
    pool, manager, session, good = baseline()
    reply = step(manager, session, **good)
    assert list(reply.released) == ["C"]
    assert [r.request_id for r in session.waiting] == ["W", "D"]  # D never jumps the queue


def test_an_unknown_request_is_not_found():
    _, manager, session = make(8)
    with pytest.raises(NotFoundError):
        step(manager, session, finished=["ghost"])


def test_another_cache_salt_gets_no_cached_tokens():
    _, manager, session = make(16)
    step(manager, session, new_requests=[new("a", list(range(8)), cache_salt=b"tenant-a")])
    step(manager, session, done=[("a", 8, [1])], finished=["a"])
    reply = step(
        manager,
        session,
        new_requests=[
            new("b", list(range(8)), cache_salt=b"tenant-b"),
            new("c", list(range(8))),
            new("d", list(range(8)), cache_salt=b"tenant-a"),
        ],
    )
    assert {r[0]: r[3] for r in rows(reply)} == {"b": 0, "c": 0, "d": 8}
