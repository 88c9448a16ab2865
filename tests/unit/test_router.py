"""The routing policy as plain code: affinity, the load bound, health, events, endpoints."""

from __future__ import annotations

import pytest

from gateway.endpoints import check_endpoint, expand
from gateway.router import NoReplica, RouteKey, Router, RouterConfig, rendezvous
from kvd.hashing import chain_block_hashes, encode_extra_keys

A, B, C = "10.0.0.1:50052", "10.0.0.2:50052", "10.0.0.3:50052"


def router(*addresses: str, **config) -> Router:
    r = Router(RouterConfig(**config))
    r.set_replicas(addresses)
    for address in addresses:
        r.set_serving(address, True)
    return r


def hashes(tokens: list[int], salt: bytes = b"tenant") -> tuple[bytes, ...]:
    return tuple(chain_block_hashes(tokens, 16, encode_extra_keys(salt)))


PROMPT = hashes(list(range(64)))  # 4 blocks


def test_a_template_goes_where_it_is_pinned_else_to_its_rendezvous_first():
    r = router(A, B, C)
    first = rendezvous(b"acme/bot", [A, B, C])[0]
    assert r.choose(RouteKey(template="acme/bot")) == first
    other = next(a for a in (A, B, C) if a != first)
    r.place("acme/bot", other)
    assert r.choose(RouteKey(template="acme/bot")) == other
    r.set_serving(other, False)  # pinned on a replica that is down: the next best
    assert r.choose(RouteKey(template="acme/bot")) == rendezvous(b"acme/bot", [a for a in (A, B, C) if a != other])[0]


def test_a_prompt_goes_to_the_replica_holding_the_longest_run_of_its_blocks():
    r = router(A, B, C)
    r.apply(A, [("stored", PROMPT[:1], 0)])
    r.apply(B, [("stored", PROMPT[:3], 0)])
    r.apply(C, [("stored", PROMPT[1:], 0)])  # not a run from the first block
    assert r.choose(RouteKey(block_hashes=PROMPT)) == B
    # Unknown everywhere: the first block's rendezvous order, the same each time.
    fresh = hashes(list(range(100, 164)))
    assert r.choose(RouteKey(block_hashes=fresh)) == rendezvous(fresh[0], [A, B, C])[0]
    # Same tokens, another tenant's salt: nothing held.
    other_tenant = hashes(list(range(64)), salt=b"other")
    assert r.choose(RouteKey(block_hashes=other_tenant)) == rendezvous(other_tenant[0], [A, B, C])[0]


def test_events_update_what_a_replica_holds():
    r = router(A, B)
    r.apply(A, [("stored", PROMPT, 0)])
    assert r.choose(RouteKey(block_hashes=PROMPT)) == A
    r.apply(A, [("removed", PROMPT[:1], 0)])  # its first block was evicted: no run left
    r.apply(B, [("stored", PROMPT[:2], 0)])
    assert r.choose(RouteKey(block_hashes=PROMPT)) == B
    r.apply(B, [("cleared", (), 0)])
    r.apply(A, [("stored", PROMPT[:1], 0)])
    assert r.choose(RouteKey(block_hashes=PROMPT)) == A
    r.forget(A)  # its event stream broke
    assert [s.known_blocks for s in r.snapshot()] == [0, 0]


def test_a_block_is_held_while_stored_in_any_tier():
    r = router(A, B)
    r.apply(A, [("stored", PROMPT, 0), ("stored", PROMPT, 1), ("removed", PROMPT, 0)])
    assert r.choose(RouteKey(block_hashes=PROMPT)) == A
    assert r.snapshot()[0].known_blocks == len(PROMPT)
    r.apply(A, [("removed", PROMPT, 1)])
    assert r.snapshot()[0].known_blocks == 0


def test_an_overloaded_target_spills_to_the_least_loaded():
    r = router(A, B, C, load_factor=1.0, load_slack=1.0)
    r.apply(A, [("stored", PROMPT, 0)])
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
    r = router(A, B)
    r.apply(A, [("stored", PROMPT, 0)])
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
    r = router(A, B)
    r.apply(A, [("stored", PROMPT, 0)])
    r.set_serving(A, False)
    assert r.choose(RouteKey(block_hashes=PROMPT)) == B
    assert r.choose(RouteKey()) == B
    r.set_serving(B, False)
    with pytest.raises(NoReplica, match="no engine replica is serving"):
        r.choose(RouteKey())


def test_round_robin_takes_turns_and_ignores_affinity():
    r = router(A, B, C, policy="round-robin")
    r.apply(A, [("stored", PROMPT, 0)])
    picks = [r.choose(RouteKey(block_hashes=PROMPT)) for _ in range(6)]
    assert sorted(set(picks)) == [A, B, C] and picks[:3] == picks[3:]


def test_replicas_come_and_go():
    r = router(A, B)
    r.apply(A, [("stored", PROMPT, 0)])
    r.set_replicas([B, C])  # A's pod is gone, C's is new (not serving until checked)
    assert r.addresses() == [B, C] and r.serving() == [B]
    r.set_serving(C, True)
    r.set_replicas([A, B, C])
    assert r.snapshot()[0].known_blocks == 0  # A came back: nothing known yet


def test_bad_configs_are_refused():
    for bad in ({"policy": "random"}, {"load_factor": 0.5}, {"load_slack": -1}):
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
