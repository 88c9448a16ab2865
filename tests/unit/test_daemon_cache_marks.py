"""Cache marks (explicit caching): a request's prefixes pinned once computed,
each reported once, expiring on the daemon's clock, under owner quotas and the
pool's pin cap; and the expiring pins of kvd.pins beside the named ones."""

from __future__ import annotations

import time

import pytest

from kvd.block_pool import BlockPool
from kvd.cache_manager import KVCacheManager
from kvd.common.hashing import encode_extra_keys, hash_token_ids
from kvd.common.layout import CacheLayout
from kvd.config import DaemonConfig
from kvd.daemon import Daemon
from kvd.errors import CapacityError, NotFoundError, PreconditionError
from kvd.marks import ENDED, SHORTER_THAN_A_BLOCK, Marker
from kvd.pins import PinRegistry
from kvd.scheduler import run_step
from kvd.session import SessionRegistry
from kvd_api.daemon.v1 import daemon_pb2 as pb
from tests.unit.test_daemon import ManualClock

BS = 4
LAYOUT = CacheLayout(num_layers=1, num_kv_heads=1, head_dim=4, block_size=BS, dtype="float32")
PROMPT = list(range(1, 11))  # two full blocks and a partial one
OTHER = list(range(100, 110))


def marks(*pairs: tuple[int, int], owner: str = "", owner_max_blocks: int = 0) -> pb.CacheMarks:
    return pb.CacheMarks(
        marks=[pb.CacheMark(num_tokens=n, ttl_seconds=ttl) for n, ttl in pairs],
        owner=owner,
        owner_max_blocks=owner_max_blocks,
    )


def new(request_id: str, tokens=PROMPT, cache_marks: pb.CacheMarks | None = None, salt: bytes = b"") -> pb.NewRequest:
    msg = pb.NewRequest(request_id=request_id, prompt_token_ids=tokens, max_new_tokens=4, cache_salt=salt)
    if cache_marks is not None:
        msg.cache_marks.CopyFrom(cache_marks)
    return msg


def results(reply: pb.StepResponse) -> list[tuple[str, int, int, str]]:
    return [(m.request_id, m.num_tokens, m.num_pinned_tokens, m.refused) for m in reply.marks]


class Engine:
    """One session of an in-process daemon, driven by Steps."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon
        self.session_id = daemon.attach("engine", LAYOUT).session.session_id

    def step(self, *new_requests: pb.NewRequest, done=(), finished=()) -> pb.StepResponse:
        """done: (request id, num_computed_tokens[, sampled token ids])."""
        sampled = [entry[2] if len(entry) > 2 else [] for entry in done]
        commits = pb.Commits(
            request_ids=[entry[0] for entry in done],
            num_computed_tokens=[entry[1] for entry in done],
            num_new_tokens=[len(tokens) for tokens in sampled],
            new_token_ids=[i for tokens in sampled for i in tokens],
        )
        msg = pb.StepRequest(new_requests=list(new_requests), commits=commits, finished=list(finished))
        return self.daemon.step(self.session_id, msg)

    def prefill(self, request: pb.NewRequest) -> pb.StepResponse:
        """Arrives, then commits its whole prompt; the commit Step's reply."""
        self.step(request)
        return self.step(done=[(request.request_id, len(request.prompt_token_ids))])


@pytest.fixture
def clock():
    return ManualClock()


def make_daemon(tmp_path, clock, num_blocks: int = 16, pinned_fraction: float = 0.5) -> Daemon:
    config = DaemonConfig(
        block_size=BS, num_blocks=num_blocks, shm_dir=str(tmp_path), max_pinned_fraction=pinned_fraction
    )
    return Daemon(config, clock=clock)


@pytest.fixture
def daemon(tmp_path, clock):
    d = make_daemon(tmp_path, clock)  # a pin cap of 8 blocks
    yield d
    d.close()


@pytest.fixture
def engine(daemon):
    return Engine(daemon)


def pinned(daemon: Daemon) -> tuple[int, int]:
    stats = daemon.stats()
    return stats.num_pins, stats.num_pinned_blocks


# ------------------------------------------------------------------ pinning


def test_a_mark_is_pinned_by_the_step_that_commits_its_prefix_and_reported_once(engine, daemon):
    reply = engine.step(new("r", cache_marks=marks((9, 60))))
    assert results(reply) == [] and list(reply.scheduled.request_ids) == ["r"]
    reply = engine.step(done=[("r", 10)])
    assert results(reply) == [("r", 9, 8, "")]  # block-aligned: two blocks
    assert reply.marks[0].ttl_seconds == 60
    assert pinned(daemon) == (1, 2)
    assert results(engine.step(done=[("r", 10)])) == []
    engine.step(finished=["r"])
    assert pinned(daemon) == (1, 2)  # the pin outlives its request
    assert daemon.mark_counts() == (1, 0)


def test_marks_are_pinned_as_a_chunked_prefill_reaches_each(engine, daemon):
    engine.step(new("r", cache_marks=marks((4, 60), (9, 60))))
    assert results(engine.step(done=[("r", 6)])) == [("r", 4, 4, "")]
    assert results(engine.step(done=[("r", 10)])) == [("r", 9, 8, "")]
    assert pinned(daemon) == (2, 2)  # nested marks share their blocks


def test_a_mark_shorter_than_a_block_is_refused_in_its_arrival_step(engine, daemon):
    reply = engine.step(new("r", cache_marks=marks((3, 60), (8, 60))))
    assert results(reply) == [("r", 3, 0, SHORTER_THAN_A_BLOCK)]
    assert results(engine.step(done=[("r", 10)])) == [("r", 8, 8, "")]


def test_a_cached_prefix_is_pinned_by_the_step_that_admits_its_request(engine, daemon):
    engine.prefill(new("warm"))
    engine.step(finished=["warm"])
    assert pinned(daemon) == (0, 0)
    reply = engine.step(new("r", cache_marks=marks((10, 60))))
    assert list(reply.scheduled.num_cached_tokens) == [8]
    assert results(reply) == [("r", 10, 8, "")]


def test_a_commit_and_a_finish_in_one_step_pin_before_the_request_goes(engine, daemon):
    engine.step(new("r", cache_marks=marks((8, 60))))
    reply = engine.step(done=[("r", 10)], finished=["r"])
    assert list(reply.released) == ["r"] and results(reply) == [("r", 8, 8, "")]


def test_a_request_that_ends_before_its_prefix_is_computed_reports_its_marks_ended(engine, daemon):
    engine.step(new("r", cache_marks=marks((4, 60), (9, 60))))
    reply = engine.step(done=[("r", 5)], finished=["r"])
    assert list(reply.released) == ["r"]
    assert results(reply) == [("r", 4, 4, ""), ("r", 9, 0, ENDED)]
    waiting = engine.step(new("w", cache_marks=marks((8, 60))), finished=["w"])  # cancelled while waiting
    assert results(waiting) == [("w", 8, 0, ENDED)]
    assert results(engine.step()) == []
    assert daemon.mark_counts() == (1, 2)


def test_a_detached_sessions_pending_marks_are_dropped(daemon):
    engine = Engine(daemon)
    engine.step(new("r", cache_marks=marks((8, 60))))
    assert daemon.detach(engine.session_id) == 1
    assert pinned(daemon) == (0, 0) and daemon.stats().num_free_blocks == 16
    assert results(Engine(daemon).step()) == []


def test_a_preempted_request_keeps_its_marks_pending(clock):
    pool = BlockPool(5)
    manager = KVCacheManager(pool, BS)
    marker = Marker(PinRegistry(pool, 4), clock, BS)
    session = SessionRegistry(60).open("engine")

    def step(*news, done=(), finished=()):
        commits = pb.Commits(
            request_ids=[r for r, *_ in done],
            num_computed_tokens=[n for _, n, *_ in done],
            num_new_tokens=[len(t) for *_, t in done],
            new_token_ids=[i for *_, t in done for i in t],
        )
        msg = pb.StepRequest(new_requests=list(news), commits=commits, finished=list(finished))
        return run_step(manager, session, msg, None, marker)

    step(new("a", list(range(1, 9))), new("b", OTHER, cache_marks=marks((8, 60))))  # 2 + 3 blocks: the pool
    reply = step(done=[("a", 8, [42])])  # a's decode needs a third block: b (newest) is preempted
    assert list(reply.preempted) == ["b"] and results(reply) == []
    assert "b" in session.marked
    reply = step(finished=["a"])
    assert list(reply.scheduled.request_ids) == ["b"] and results(reply) == []
    assert results(step(done=[("b", 10, [])])) == [("b", 8, 8, "")]
    assert session.marked == {}


# ------------------------------------------------------- refresh and expiry


def test_the_same_prefix_marked_again_refreshes_one_pin_to_the_later_expiry(engine, daemon, clock):
    assert results(engine.prefill(new("a", cache_marks=marks((8, 60)))))[0][2] == 8
    clock.advance(10)
    assert results(engine.step(new("b", cache_marks=marks((9, 100)))))[0][2] == 8  # cached: admission pins
    assert pinned(daemon) == (1, 2)
    engine.step(finished=["a", "b"])
    clock.advance(60)  # past a's expiry, before b's
    daemon.reap_expired()
    assert pinned(daemon) == (1, 2)
    clock.advance(40)  # at b's: 10 + 100
    daemon.reap_expired()
    assert pinned(daemon) == (0, 0)


def test_a_shorter_ttl_does_not_shorten_a_pin(engine, daemon, clock):
    engine.prefill(new("a", cache_marks=marks((8, 100))))
    engine.step(new("b", cache_marks=marks((8, 10))), finished=["a"])
    clock.advance(50)
    daemon.reap_expired()
    assert pinned(daemon) == (1, 2)


def test_an_expired_pin_leaves_its_blocks_cached_and_evictable(engine, daemon, clock):
    engine.prefill(new("r", cache_marks=marks((8, 30))))
    engine.step(finished=["r"])
    assert daemon.stats().num_free_blocks == 14
    clock.advance(29.9)
    daemon.reap_expired()
    assert pinned(daemon) == (1, 2)
    clock.advance(0.1)
    daemon.reap_expired()
    stats = daemon.stats()
    assert (stats.num_pins, stats.num_pinned_blocks, stats.num_free_blocks) == (0, 0, 16)
    assert daemon.cached_prefix(PROMPT, b"", []).device_hashes  # still cached, now evictable


def test_the_reaper_thread_expires_pins(tmp_path, clock):
    config = DaemonConfig(block_size=BS, num_blocks=16, shm_dir=str(tmp_path), lease_s=0.04)
    daemon = Daemon(config, clock=clock)  # its reaper passes every 10 ms
    try:
        engine = Engine(daemon)
        engine.prefill(new("r", cache_marks=marks((8, 1))))
        engine.step(finished=["r"])
        assert pinned(daemon) == (1, 2)
        clock.advance(1)
        daemon.start()
        deadline = time.monotonic() + 10
        while pinned(daemon) != (0, 0) and time.monotonic() < deadline:
            time.sleep(0.005)
        assert pinned(daemon) == (0, 0)
    finally:
        daemon.close()


# --------------------------------------------------------- quotas and caps


def test_a_mark_over_its_owners_quota_is_refused_and_its_request_runs_on(engine, daemon):
    reply = engine.prefill(new("r", cache_marks=marks((4, 60), (8, 60), owner="t1", owner_max_blocks=1)))
    assert results(reply) == [
        ("r", 4, 4, ""),
        ("r", 8, 0, "1 more blocks would exceed the owner's pin quota of 1 blocks (it holds 1)"),
    ]
    assert pinned(daemon) == (1, 1)
    reply = engine.step(done=[("r", 10, [42])])
    assert list(reply.scheduled.request_ids) == ["r"]  # decoding on


def test_owners_quotas_are_independent_and_count_distinct_blocks(engine, daemon):
    t1 = marks((4, 60), (8, 60), owner="t1", owner_max_blocks=2)
    assert [r[2] for r in results(engine.prefill(new("a", cache_marks=t1)))] == [4, 8]  # 2 distinct blocks
    t2 = marks((8, 60), owner="t2", owner_max_blocks=2)
    assert results(engine.prefill(new("b", OTHER, cache_marks=t2))) == [("b", 8, 8, "")]
    more = marks((8, 60), owner="t1", owner_max_blocks=2)
    refused = results(engine.prefill(new("c", [7] * 10, cache_marks=more)))[0][3]
    assert "owner's pin quota of 2 blocks" in refused
    assert pinned(daemon) == (3, 4)
    assert daemon.cache.pins.owned_blocks("t1") == daemon.cache.pins.owned_blocks("t2") == 2


def test_a_mark_over_the_daemons_pin_cap_is_refused(tmp_path, clock):
    daemon = make_daemon(tmp_path, clock, pinned_fraction=0.125)  # a cap of 2 blocks
    try:
        engine = Engine(daemon)
        assert results(engine.prefill(new("a", cache_marks=marks((8, 60)))))[0][2] == 8
        refused = results(engine.prefill(new("b", OTHER, cache_marks=marks((4, 60)))))
        assert refused == [("b", 4, 0, "1 more blocks would exceed the daemon's pin cap of 2 blocks (2 are pinned)")]
        assert pinned(daemon) == (1, 2)
        reply = engine.step(done=[("a", 10, [42]), ("b", 10, [43])])
        assert list(reply.scheduled.request_ids) == ["a", "b"]
    finally:
        daemon.close()


def test_tenants_marking_the_same_tokens_get_pins_of_their_own(engine, daemon):
    engine.prefill(new("a", cache_marks=marks((8, 60)), salt=b"t1"))
    engine.prefill(new("b", cache_marks=marks((8, 60)), salt=b"t2"))
    assert pinned(daemon) == (2, 4)


# ------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("cache_marks", "field"),
    [
        (marks(*[(n, 60) for n in (1, 2, 3, 4, 5)]), r"cache_marks\.marks: at most 4"),
        (marks((0, 60)), r"cache_marks\.marks\[0\]\.num_tokens"),
        (marks((11, 60)), r"cache_marks\.marks\[0\]\.num_tokens"),
        (marks((8, 60), (8, 60)), r"cache_marks\.marks\[1\]\.num_tokens"),
        (marks((8, 60), (4, 60)), r"cache_marks\.marks\[1\]\.num_tokens"),
        (marks((8, 0)), r"cache_marks\.marks\[0\]\.ttl_seconds"),
        (marks((8, 7 * 24 * 3600 + 1)), r"cache_marks\.marks\[0\]\.ttl_seconds"),
        (marks((8, 60), owner_max_blocks=-1), r"cache_marks\.owner_max_blocks"),
    ],
)
def test_bad_marks_refuse_the_step_whole(engine, daemon, cache_marks, field):
    with pytest.raises(ValueError, match=r"^new_requests\[1\]\." + field):
        engine.step(new("ok", cache_marks=marks((8, 60))), new("bad", cache_marks=cache_marks))
    assert daemon.stats().num_requests == 0
    assert results(engine.step(new("ok", cache_marks=marks((8, 60))))) == []  # "ok" is new: nothing was kept


def test_the_longest_ttl_and_a_mark_at_the_prompts_end_are_accepted(engine, daemon):
    engine.step(new("r", cache_marks=marks((10, 7 * 24 * 3600))))
    assert results(engine.step(done=[("r", 10)])) == [("r", 10, 8, "")]


# ------------------------------------------------- named pins, stats, reset


def test_named_pins_keep_their_behaviour_beside_marks(engine, daemon, clock):
    engine.prefill(new("r", cache_marks=marks((8, 30))))
    engine.step(finished=["r"])
    assert daemon.pin("template", PROMPT, b"", []) == 2
    assert pinned(daemon) == (2, 2)  # two pins, the same two blocks
    mark_id = next(iter(daemon.cache.pins.expiring))
    with pytest.raises(NotFoundError):
        daemon.unpin(mark_id)  # a mark is not a named pin
    clock.advance(30)
    daemon.reap_expired()
    assert pinned(daemon) == (1, 2)  # the template's pin holds on
    assert daemon.unpin("template") == 2
    assert pinned(daemon) == (0, 0) and daemon.stats().num_free_blocks == 16


def test_reset_drops_marks_but_is_refused_while_a_named_pin_holds_blocks(engine, daemon):
    engine.prefill(new("r", cache_marks=marks((8, 600))))
    engine.step(finished=["r"])
    daemon.pin("template", OTHER, b"", [])  # nothing of OTHER cached: pins nothing
    assert daemon.reset() == 2
    assert pinned(daemon) == (1, 0)
    engine.prefill(new("a", cache_marks=marks((8, 600))))
    engine.step(finished=["a"])
    daemon.pin("template", PROMPT, b"", [])
    with pytest.raises(PreconditionError):
        daemon.reset()
    assert pinned(daemon) == (2, 2)  # refused: nothing changed


# ------------------------------------------------------- the registry alone


def _registry(cap: int = 4):
    pool = BlockPool(8)
    manager = KVCacheManager(pool, BS)
    for tokens in (PROMPT, OTHER):
        request = manager.new_request("warm", tokens)
        manager.admit(request, 100)
        manager.commit(request, len(tokens))
        manager.free(request)
    return pool, PinRegistry(pool, cap)


def _hashes(tokens):
    return hash_token_ids(tokens, BS, encode_extra_keys())


def test_an_expiring_pin_over_a_limit_changes_nothing():
    pool, pins = _registry(cap=3)
    pins.pin_until("a", _hashes(PROMPT), 10.0, owner="t", owner_max_blocks=3)
    before = ([b.ref_cnt for b in pool.blocks], pool.num_free, pins.num_pinned_blocks, pins.owned_blocks("t"))
    with pytest.raises(CapacityError, match="owner's pin quota of 3 blocks"):
        pins.pin_until("b", _hashes(OTHER), 10.0, owner="t", owner_max_blocks=3)
    with pytest.raises(CapacityError, match="daemon's pin cap of 3 blocks"):
        pins.pin_until("b", _hashes(OTHER), 10.0, owner="u")
    assert ([b.ref_cnt for b in pool.blocks], pool.num_free, pins.num_pinned_blocks, pins.owned_blocks("t")) == before
    assert set(pins.expiring) == {"a"} and pins.owned_blocks("u") == 0


def test_expire_follows_refreshes_and_frees_each_pin_once():
    pool, pins = _registry(cap=8)
    pins.pin_until("a", _hashes(PROMPT), 10.0)
    pins.pin_until("b", _hashes(OTHER), 20.0)
    pins.pin_until("a", _hashes(PROMPT), 30.0)  # refreshed
    pins.pin_until("a", _hashes(PROMPT), 5.0)  # an earlier expiry changes nothing
    assert pins.expire(9.0) == 0
    assert pins.expire(10.0) == 0 and set(pins.expiring) == {"a", "b"}
    assert pins.expire(20.0) == 1 and set(pins.expiring) == {"a"}
    assert pins.expire(30.0) == 1 and pins.num_pins == 0
    assert pins.num_pinned_blocks == 0 and pool.num_free == 8 and pins.owned_blocks("") == 0
    assert pins.expire(1e9) == 0
