"""The routing policies as plain code: cost, affinity and its load bound, health, events, the index, endpoints."""

from __future__ import annotations

import threading

import pytest

from gateway.block_index import BlockIndex, index_keys
from gateway.endpoints import check_endpoint, expand
from gateway.router import Cleared, Load, NoReplica, Removed, Route, RouteKey, Router, RouterConfig, Stored, rendezvous
from kvd.common.hashing import encode_extra_keys, hash_token_ids

A, B, C = "10.0.0.1:50052", "10.0.0.2:50052", "10.0.0.3:50052"


def router(*addresses: str, clock=None, **config) -> Router:
    r = Router(RouterConfig(**config), **({"clock": clock} if clock else {}))
    r.set_replicas(addresses)
    for address in addresses:
        r.set_serving(address, True)
    return r


def hashes(tokens: list[int], salt: bytes = b"tenant") -> tuple[bytes, ...]:
    return tuple(hash_token_ids(tokens, 16, encode_extra_keys(salt)))


PROMPT = hashes(list(range(64)))  # 4 blocks


def test_a_template_goes_where_it_is_pinned_else_to_its_rendezvous_first():
    r = router(A, B, C, policy="affinity")
    first = rendezvous(b"acme/bot", [A, B, C])[0]
    assert r.choose(RouteKey(template="acme/bot")) == first
    other = next(a for a in (A, B, C) if a != first)
    r.place("acme/bot", other)
    assert r.choose(RouteKey(template="acme/bot")) == other
    r.set_serving(other, False)  # pinned on a replica that is down: the next best
    assert r.choose(RouteKey(template="acme/bot")) == rendezvous(b"acme/bot", [a for a in (A, B, C) if a != other])[0]


def test_a_prompt_goes_to_the_replica_holding_the_longest_run_of_its_blocks():
    r = router(A, B, C, policy="affinity")
    r.record_events(A, [Stored(PROMPT[:1], 0)])
    r.record_events(B, [Stored(PROMPT[:3], 0)])
    r.record_events(C, [Stored(PROMPT[1:], 0)])  # not a run from the first block
    assert r.choose(RouteKey(block_hashes=PROMPT)) == B
    # Unknown everywhere: the first block's rendezvous order, the same each time.
    fresh = hashes(list(range(100, 164)))
    assert r.choose(RouteKey(block_hashes=fresh)) == rendezvous(fresh[0], [A, B, C])[0]
    # Same tokens, another tenant's salt: nothing held.
    other_tenant = hashes(list(range(64)), salt=b"other")
    assert r.choose(RouteKey(block_hashes=other_tenant)) == rendezvous(other_tenant[0], [A, B, C])[0]


def test_events_update_what_a_replica_holds():
    r = router(A, B, policy="affinity")
    r.record_events(A, [Stored(PROMPT, 0)])
    assert r.choose(RouteKey(block_hashes=PROMPT)) == A
    r.record_events(A, [Removed(PROMPT[:1], 0)])  # its first block was evicted: no run left
    r.record_events(B, [Stored(PROMPT[:2], 0)])
    assert r.choose(RouteKey(block_hashes=PROMPT)) == B
    r.record_events(B, [Cleared()])
    r.record_events(A, [Stored(PROMPT[:1], 0)])
    assert r.choose(RouteKey(block_hashes=PROMPT)) == A
    r.forget(A)  # its event stream broke
    assert [s.known_blocks for s in r.snapshot()] == [0, 0]


def test_a_block_is_held_while_stored_in_any_tier():
    r = router(A, B, policy="affinity")
    r.record_events(A, [Stored(PROMPT, 0), Stored(PROMPT, 1), Removed(PROMPT, 0)])
    assert r.choose(RouteKey(block_hashes=PROMPT)) == A
    assert (r.snapshot()[0].known_blocks, r.snapshot()[0].known_host_blocks) == (0, len(PROMPT))
    r.record_events(A, [Removed(PROMPT, 1)])
    assert r.snapshot()[0].known_host_blocks == 0


def test_an_overloaded_target_spills_to_the_least_loaded():
    r = router(A, B, C, policy="affinity", load_factor=1.0, load_slack=1.0)
    r.record_events(A, [Stored(PROMPT, 0)])
    key = RouteKey(block_hashes=PROMPT)
    placed = []
    for _ in range(6):
        address = r.choose(key)
        r.started(address)
        placed.append(address)
    # The bound is load + 1 <= 1.0 * mean + 1: A goes at most one ahead of the mean.
    assert placed == [A, B, A, C, B, A]
    for address in placed:
        r.finished(address)
    assert r.choose(key) == A  # the load is gone: back to affinity


def test_the_default_bound_keeps_affinity_under_moderate_imbalance():
    r = router(A, B, policy="affinity")
    r.record_events(A, [Stored(PROMPT, 0)])
    for _ in range(3):
        r.started(A)
    # mean = (3 + 1) / 2 = 2; 1.5 * 2 + 2 = 5 >= 4: A still takes it, and up to
    # its 8th request (8 <= 1.5 * 8 / 2 + 2) while B runs none.
    assert r.choose(RouteKey(block_hashes=PROMPT)) == A
    for _ in range(4):
        r.started(A)
    assert r.choose(RouteKey(block_hashes=PROMPT)) == A
    r.started(A)
    assert r.choose(RouteKey(block_hashes=PROMPT)) == B


def test_replicas_that_do_not_serve_are_skipped():
    r = router(A, B, policy="affinity")
    r.record_events(A, [Stored(PROMPT, 0)])
    r.set_serving(A, False)
    assert r.choose(RouteKey(block_hashes=PROMPT)) == B
    assert r.choose(RouteKey()) == B
    r.set_serving(B, False)
    with pytest.raises(NoReplica, match="no engine replica is serving"):
        r.choose(RouteKey())


def test_round_robin_takes_turns_and_ignores_affinity():
    r = router(A, B, C, policy="round-robin")
    r.record_events(A, [Stored(PROMPT, 0)])
    picks = [r.choose(RouteKey(block_hashes=PROMPT)) for _ in range(6)]
    assert sorted(set(picks)) == [A, B, C] and picks[:3] == picks[3:]


def test_replicas_come_and_go():
    r = router(A, B)
    r.record_events(A, [Stored(PROMPT, 0)])
    r.set_replicas([B, C])  # A's pod is gone, C's is new (not serving until checked)
    assert r.addresses() == [B, C] and r.serving() == [B]
    r.set_serving(C, True)
    r.set_replicas([A, B, C])
    assert r.snapshot()[0].known_blocks == 0  # A came back: nothing known yet


def test_bad_configs_are_refused():
    for bad in ({"policy": "random"}, {"load_factor": 0.5}, {"load_slack": -1}, {"work_weight": 0}, {"token_s": 0}):
        with pytest.raises(ValueError):
            RouterConfig(**bad)


def test_rendezvous_moves_only_the_keys_of_a_replica_that_leaves():
    keys = [f"t{i}".encode() for i in range(200)]
    before = {k: rendezvous(k, [A, B, C])[0] for k in keys}
    after = {k: rendezvous(k, [A, B])[0] for k in keys}
    assert all(after[k] == before[k] for k in keys if before[k] != C)
    assert 40 < sum(1 for k in keys if before[k] == C) < 100  # about a third


def test_endpoints_expand_dns_names_and_keep_fixed_addresses():
    table = {"engines.svc": ["10.1.0.7:50052", "10.1.0.5:50052"], "gone.svc": []}
    resolve = lambda name, port: [a.replace("50052", str(port)) for a in table[name]]  # noqa: E731
    entries = ["dns:engines.svc:50052", "127.0.0.1:50060", "dns:gone.svc:1"]
    assert expand(entries, resolve) == ["10.1.0.5:50052", "10.1.0.7:50052", "127.0.0.1:50060"]
    table["engines.svc"] = ["10.1.0.9:50052"]  # pods came and went
    assert expand(entries, resolve) == ["10.1.0.9:50052", "127.0.0.1:50060"]
    assert "127.0.0.1:7" in expand(["dns:localhost:7"])  # the real resolver
    for bad in ("nohost", "dns:name", "h:0", "h:x", ":80"):
        with pytest.raises(ValueError):
            check_endpoint(bad)


# ------------------------------------------------------------------ cost


def key(tokens: list[int], salt: bytes = b"tenant", **kw) -> RouteKey:
    return RouteKey(block_hashes=hashes(tokens, salt), num_tokens=len(tokens), **kw)


LONG = list(range(640))  # 40 blocks


def test_cost_prefers_the_replica_holding_the_prompt_while_its_queue_is_short():
    clock = [0.0]
    r = router(A, B, C, clock=lambda: clock[0])
    prompt = key(LONG)
    r.record_events(B, [Stored(prompt.block_hashes[:30], 0)])
    assert r.route(prompt) == Route(B, 640 - 30 * 16)
    # B reports a long queue: 10 uncached blocks elsewhere cost less than waiting.
    for address in (A, C):
        r.report_load(address, Load(queued_tokens=0, forward_s=0.01, token_s=1e-4, token_budget=512))
    r.report_load(B, Load(queued_tokens=20_000, forward_s=0.01, token_s=1e-4, token_budget=512))
    assert r.choose(prompt) != B
    r.report_load(B, Load(queued_tokens=100, forward_s=0.01, token_s=1e-4, token_budget=512))
    assert r.choose(prompt) == B


def test_cost_counts_this_gateways_requests_until_a_report_covers_them():
    clock = [0.0]
    r = router(A, B, clock=lambda: clock[0], report_lag_s=0.05)
    first = r.route(key(LONG))
    ticket = r.started(first.address, first.uncached_tokens)
    other = next(a for a in (A, B) if a != first.address)
    assert r.choose(key(list(range(1000, 1640)))) == other  # 640 tokens queued there by this gateway
    clock[0] = 1.0  # reports that include it: counted once, not twice
    rate = {"forward_s": 0.02, "token_s": 1e-4, "token_budget": 2048}
    r.report_load(first.address, Load(queued_tokens=640, **rate))
    r.report_load(other, Load(queued_tokens=1000, **rate))
    assert r.choose(key(list(range(3000, 3640)))) == first.address
    r.prefilled(first.address, ticket)
    r.finished(first.address, ticket)
    assert [v.in_flight for v in r.snapshot()] == [0, 0]
    r.forget_load(other)  # its load stream broke: nothing known queued there
    assert r.choose(key(list(range(5000, 5640)))) == other


def test_a_busier_fleet_weighs_a_cache_miss_more():
    clock = [0.0]
    r = router(A, B, C, clock=lambda: clock[0])
    prompt = key(LONG)  # 640 tokens: B holds 480 of them
    r.record_events(B, [Stored(prompt.block_hashes[:30], 0)])
    r.started(A, 640)  # a request's uncached tokens, as this gateway has seen them
    clock[0] = 1.0
    rate = {"forward_s": 0.0, "token_s": 1e-4, "token_budget": 2048}

    def queues(a: int, b: int, c: int) -> str:
        for address, queued in ((A, a), (B, b), (C, c)):
            r.report_load(address, Load(queued_tokens=queued, **rate))
        return r.choose(prompt)

    # B has 3000 tokens more queued than the others. Near idle, that wait
    # costs more than computing 480 tokens again elsewhere...
    assert queues(0, 3000, 0) != B
    # ... but when every queue is long, more requests will wait behind a miss.
    assert queues(9000, 12_000, 9000) == B


def test_a_replica_not_measured_yet_is_estimated_at_the_fleets_rate():
    r = router(A, B)
    prompt = key(LONG, template="acme/bot", template_blocks=30)
    r.place("acme/bot", A)
    # A prefilled one long prompt (a slow fit); B never ran: it reports no rate.
    r.report_load(A, Load(queued_tokens=0, forward_s=0.5, token_s=2e-3, token_budget=512))
    r.report_load(B, Load(queued_tokens=0, forward_s=0.0, token_s=0.0, token_budget=512))
    assert r.choose(prompt) == A  # not to B for looking fast: both at A's rate, A holds 30 blocks


def test_cost_spreads_new_conversations_behind_a_shared_system_prompt():
    r = router(*[f"10.0.1.{i}:1" for i in range(8)])
    system = list(range(320))  # 20 blocks every replica holds
    for address in r.addresses():
        r.record_events(address, [Stored(hashes(system), 0)])
    picks = {r.choose(key(system + [10_000 + c] * 64)) for c in range(64)}
    assert len(picks) >= 6  # by each conversation's own first block, not the address order
    # The same conversation asked again goes to the same replica (nothing queued anywhere).
    convo = key(system + [99] * 64)
    assert len({r.choose(convo) for _ in range(5)}) == 1


def test_a_replica_lacking_only_the_fleets_common_prefix_still_gets_new_conversations():
    addresses = [f"10.0.2.{i}:1" for i in range(4)]
    r = router(*addresses)
    system = list(range(320))
    for address in addresses[:3]:  # the fourth is new: its cache is empty
        r.record_events(address, [Stored(hashes(system), 0)])
    picks = {r.choose(key(system + [20_000 + c] * 64)) for c in range(40)}
    assert addresses[3] in picks and len(picks) == 4


def test_cost_keeps_a_templated_request_on_the_template_replica():
    r = router(A, B, C)
    template = list(range(200))
    prompt = key(template + [7] * 20, template="acme/bot", template_blocks=len(template) // 16)
    r.place("acme/bot", C)
    assert r.choose(prompt) == C  # no event yet: the pin says it is there
    for address in (A, B, C):  # cached everywhere (A and B stood in for it): a tie, its replica wins
        r.record_events(address, [Stored(prompt.block_hashes[:12], 0)])
    assert r.choose(prompt) == C
    r.set_serving(C, False)
    assert r.choose(prompt) == rendezvous(b"acme/bot", [A, B])[0]


def test_the_index_finds_every_replicas_run_in_one_search():
    index = BlockIndex()
    blocks = hashes(LONG)
    keys = index_keys(blocks)
    index.stored(0, 0, blocks[:10])
    index.stored(1, 0, blocks[:25])
    index.stored(2, 1, blocks[:5])  # host tier counts as held
    index.stored(3, 0, blocks[1:])  # no run from the first block
    assert index.run_lengths(keys, 0b1111) == {0: 10, 1: 25, 2: 5}
    assert index.run_lengths(keys, 0b1) == {0: 10}  # only the candidates asked about
    assert index.num_entries() == 40 + 5  # one entry a block per tier, whoever holds it
    index.removed(1, 0, blocks[20:])  # its tail evicted
    assert index.run_lengths(keys, 0b1111)[1] == 20
    index.clear(1)
    assert index.known(1) == 0 and index.known(0) == 10 and index.known(2, 1) == 5
    assert 1 not in index.run_lengths(keys, 0b1111)
    assert index.run_lengths((), 0b1111) == {}
    # Many replicas, runs of every length, in both tiers.
    index = BlockIndex()
    for slot in range(64):
        index.stored(slot, slot % 2, blocks[: (slot * 7) % 41])
    expected = {slot: (slot * 7) % 41 for slot in range(64) if (slot * 7) % 41}
    assert index.run_lengths(keys, (1 << 64) - 1) == expected


def test_a_turn_sent_before_its_previous_turn_is_prefilled_follows_it():
    """The previous turn's blocks are promised to its replica from the moment it
    is sent: the next turn queued behind it there finds them cached."""
    r = router(*[f"10.0.3.{i}:1" for i in range(8)])
    first = key(LONG[:320])  # 20 blocks, held nowhere yet
    route = r.route(first)
    ticket = r.started(route.address, route.uncached_tokens, route.new_keys)
    following = key(LONG)  # its prompt extends the first's
    assert r.route(following) == Route(route.address, 640 - 20 * 16)
    # Its prefill ended and the daemon's events say the same: no promise is left over.
    r.record_events(route.address, [Stored(first.block_hashes, 0)])
    r.prefilled(route.address, ticket)
    assert r.route(following) == Route(route.address, 640 - 20 * 16)
    r.record_events(route.address, [Removed(first.block_hashes, 0)])
    assert r.route(following).uncached_tokens == 640


def test_promised_blocks_count_every_request_that_promised_them():
    index = BlockIndex()
    keys = index_keys(hashes(LONG))
    index.stored(0, 0, hashes(LONG)[:5])
    index.promise(0, keys[5:20])  # a request that held the first 5 blocks there
    index.promise(0, keys[5:10])
    index.promise(1, keys[:3])
    assert index.run_lengths(keys, 0b11) == {0: 20, 1: 3}
    index.unpromise(0, keys[5:20])
    assert index.run_lengths(keys, 0b11) == {0: 10, 1: 3}
    index.unpromise(0, keys[5:10])
    index.unpromise(1, keys[:3])
    assert index.run_lengths(keys, 0b11) == {0: 5} and index.num_promised() == 0


def test_a_request_refused_by_a_replica_goes_to_another_and_none_left_is_unavailable():
    r = router(A, B, policy="cost")
    r.record_events(A, [Stored(PROMPT, 0)])
    key = RouteKey(block_hashes=PROMPT, num_tokens=64, block_size=16)
    assert r.route(key).address == A
    assert r.route(key, exclude={A}).address == B  # A handed it back (draining)
    with pytest.raises(NoReplica):
        r.route(key, exclude={A, B})
    assert r.route(key).address == A  # an exclusion is one request's, not the router's


def test_a_replica_that_refused_a_request_may_take_it_again_once_it_serves_anew():
    r = router(A, B)
    tried = {A: r.comebacks(A), B: r.comebacks(B)}  # both refused it (draining)
    assert r.refusers(tried) == {A, B}
    r.set_serving(A, False)
    r.set_serving(A, True)  # replaced: a new engine on A's address
    assert r.refusers(tried) == {B}
    r.set_serving(B, True)  # no change of state: still the engine that refused
    assert r.refusers(tried) == {B}


def test_a_replica_is_expected_back_only_for_a_while_after_it_stopped_serving():
    now = [100.0]
    r = router(A, clock=lambda: now[0])
    assert r.served_within(30)
    r.set_serving(A, False)
    now[0] += 29
    assert r.served_within(30)
    now[0] += 2
    assert not r.served_within(30)
    never = Router()
    never.set_replicas([B])
    assert not never.served_within(30)  # a replica that never served is not expected


def test_a_wait_for_a_serving_replica_ends_when_one_comes_back_and_not_for_a_refuser():
    r = router(A, B)
    tried = {A: r.comebacks(A), B: r.comebacks(B)}
    r.set_serving(A, False)
    r.set_serving(B, False)
    assert not r.wait_serving(tried, 0.0)
    came_back = threading.Event()

    def restore() -> None:
        r.set_serving(B, True)  # B again: it counts anew (a new engine on B's address)
        came_back.set()

    timer = threading.Timer(0.05, restore)
    timer.start()
    try:
        assert r.wait_serving(tried, 600)  # woken by the change, not by the timeout
        assert came_back.is_set()
    finally:
        timer.cancel()
    assert r.route(RouteKey(), exclude=r.refusers(tried)).address == B


def test_replicas_of_one_cache_share_its_templates_and_the_router_knows_its_caches():
    D = "10.0.0.4:50052"
    r = router(A, B, C, D, policy="cost")
    r.set_cache(A, "cache-1")
    r.set_cache(B, "cache-1")  # two engines on one daemon
    r.set_cache(C, "cache-2")
    assert r.serving_by_cache() == {"cache-1": [A, B], "cache-2": [C]}  # D's cache is not known yet
    r.place("acme/bot", A)
    key = RouteKey(template="acme/bot", num_tokens=640, block_size=16, template_blocks=32)
    r.started(A, 64)  # A is busier: its peer B holds the template too and wins
    assert r.route(key).address == B
    assert r.route(key).uncached_tokens == 640 - 32 * 16
    r.set_serving(A, False)
    assert r.known_caches() == {"cache-1", "cache-2"}  # a replica that is down keeps its cache
    assert r.serving_by_cache() == {"cache-1": [B], "cache-2": [C]}
    assert r.cache_of(A) == "cache-1" and r.cache_of(None) == "" and r.cache_of("nowhere:1") == ""
