"""The template keeper (``gateway/keeper.py``) against small fake replicas: a
real ``Router``, templates in the real Redis at 127.0.0.1:6379, and engine
links that answer ``Warm``, ``Unpin`` and ``Info`` as a daemon with a pin
cap would."""

from __future__ import annotations

import grpc
import pytest

from gateway.keeper import TemplateKeeper, pin_id
from gateway.router import NoReplica, Router, RouterConfig
from gateway.templates import TemplateStore, warm_member
from kvd_api.engine.v1 import engine_pb2 as epb

REPLICAS = ["10.0.0.1:50052", "10.0.0.2:50052", "10.0.0.3:50052"]
BLOCK = 16


class EngineError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str = "") -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class FakeCache:
    """A daemon's pins, capped (0: no cap)."""

    def __init__(self, cache_id: str, cap: int = 0) -> None:
        self.cache_id = cache_id
        self.cap = cap
        self.pins: set[str] = set()


class FakeStub:
    def __init__(self, replica: FakeReplica) -> None:
        self.replica = replica

    def Warm(self, request: epb.WarmRequest, timeout=None) -> epb.WarmResponse:
        self.replica.warms.append(request.pin_id)
        cache = self.replica.cache
        if self.replica.unavailable:
            raise EngineError(grpc.StatusCode.UNAVAILABLE, "gone")
        if cache.cap and request.pin_id not in cache.pins and len(cache.pins) >= cache.cap:
            raise EngineError(grpc.StatusCode.RESOURCE_EXHAUSTED, "pin cap")
        cache.pins.add(request.pin_id)
        pinned = len(request.token_ids) // BLOCK * BLOCK
        return epb.WarmResponse(cached_tokens=pinned, pinned_tokens=pinned)

    def Unpin(self, request: epb.UnpinRequest, timeout=None) -> epb.UnpinResponse:
        if request.pin_id not in self.replica.cache.pins:
            raise EngineError(grpc.StatusCode.NOT_FOUND, "not pinned")
        self.replica.cache.pins.discard(request.pin_id)
        return epb.UnpinResponse(unpinned_blocks=1)


class FakeReplica:
    """What the keeper uses of an ``EngineLink``."""

    rpc_timeout_s = 1.0

    def __init__(self, address: str, cache: FakeCache) -> None:
        self.address = address
        self.cache = cache
        self.unavailable = False
        self.warms: list[str] = []
        self.stub = FakeStub(self)

    def info(self, timeout_s=None) -> epb.InfoResponse:
        return epb.InfoResponse(cache_id=self.cache.cache_id, block_size=BLOCK)


class FakePool:
    """What the keeper uses of a ``ReplicaPool``: a real router, fake links, no waiting."""

    replica_wait_s = 0.0

    def __init__(self, replicas: dict[str, FakeReplica]) -> None:
        self.replicas = replicas
        self.router = Router(RouterConfig(policy="affinity"))
        self.router.set_replicas(replicas)
        for address in replicas:
            self.router.set_serving(address, True)

    def link(self, address: str) -> FakeReplica:
        return self.replicas[address]

    def mark_down(self, address: str) -> None:
        self.router.set_serving(address, False)

    def await_serving(self, tried, timeout_s: float) -> bool:
        return False


def pool_of(*caches: FakeCache) -> FakePool:
    """One replica per cache given, on REPLICAS' addresses in order."""
    return FakePool({address: FakeReplica(address, cache) for address, cache in zip(REPLICAS, caches, strict=False)})


def create(store: TemplateStore, name: str, tokens: int = 40):
    return store.create("acme", name, "x", list(range(tokens)), 0, "")


def test_a_template_is_pinned_once_on_the_first_replica_of_its_rendezvous_order(store):
    pool = pool_of(FakeCache("a"), FakeCache("b"), FakeCache("c"))
    keeper = TemplateKeeper(store, pool)
    template = create(store, "bot")
    member = warm_member("acme", "bot")
    home = pool.router.template_order(member)[0]

    assert keeper.warm(template) == 32  # its block-aligned prefix
    assert [a for a, r in pool.replicas.items() if r.warms] == [home]
    assert pool.router.placement(member) == home
    assert keeper.pinned_on(home) == 1 and sum(keeper.pinned_on(a) for a in REPLICAS) == 1
    assert store.warm_members() == [member] and store.get("acme", "bot").cached_tokens == 32


def test_a_full_cache_passes_the_template_to_the_next_replica(store):
    pool = pool_of(FakeCache("a", cap=1), FakeCache("b", cap=1), FakeCache("c", cap=1))
    keeper = TemplateKeeper(store, pool)
    member = warm_member("acme", "bot")
    first, second, _ = pool.router.template_order(member)
    pool.replicas[first].cache.pins.add("template:acme/other")  # its cap is taken

    keeper.warm(create(store, "bot"))
    assert pool.router.placement(member) == second
    assert pool.replicas[second].cache.pins == {pin_id("acme", "bot")}


def test_every_cache_full_is_the_daemons_refusal(store):
    pool = pool_of(FakeCache("a", cap=1), FakeCache("b", cap=1))
    for replica in pool.replicas.values():
        replica.cache.pins.add("template:acme/other")
    with pytest.raises(grpc.RpcError) as info:
        TemplateKeeper(store, pool).warm(create(store, "bot"))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_an_unavailable_replica_is_marked_down_and_skipped(store):
    pool = pool_of(FakeCache("a"), FakeCache("b"))
    member = warm_member("acme", "bot")
    first, second = pool.router.template_order(member)
    pool.replicas[first].unavailable = True

    TemplateKeeper(store, pool).warm(create(store, "bot"))
    assert pool.router.serving() == [second] and pool.router.placement(member) == second


def test_no_serving_replica_is_no_replica(store):
    pool = pool_of(FakeCache("a"))
    pool.router.set_serving(REPLICAS[0], False)
    with pytest.raises(NoReplica):
        TemplateKeeper(store, pool).warm(create(store, "bot"))


def test_release_unpins_in_every_serving_cache_and_leaves_the_warm_set(store):
    pool = pool_of(FakeCache("a"), FakeCache("b"))
    keeper = TemplateKeeper(store, pool)
    keeper.reconcile()  # learns the caches
    keeper.warm(create(store, "bot"))

    assert keeper.release("acme", "bot")
    assert all(not r.cache.pins for r in pool.replicas.values())
    assert store.warm_members() == [] and pool.router.placement(warm_member("acme", "bot")) is None


def test_a_deleted_template_is_swept_from_its_cache(store):
    pool = pool_of(FakeCache("a"), FakeCache("b"))
    keeper = TemplateKeeper(store, pool)
    keeper.warm(create(store, "bot"))
    store.delete("acme", "bot")  # as another gateway would, without telling this one

    keeper.reconcile()
    assert all(not r.cache.pins for r in pool.replicas.values())
    assert store.warm_members() == []


def test_a_cache_that_restarted_gets_its_templates_warmed_again(store):
    pool = pool_of(FakeCache("a"))
    keeper = TemplateKeeper(store, pool)
    keeper.warm(create(store, "bot"))
    replica = pool.replicas[REPLICAS[0]]
    replica.cache = FakeCache("a-restarted")  # a new daemon: a new, empty cache

    keeper.reconcile()
    assert replica.cache.pins == {pin_id("acme", "bot")} and len(replica.warms) == 2
    assert keeper.pinned_on(REPLICAS[0]) == 1


def test_replicas_of_one_cache_share_its_pin_and_a_drain_moves_the_home_alone(store):
    shared = FakeCache("shared")
    pool = pool_of(shared, shared)
    keeper = TemplateKeeper(store, pool)
    keeper.reconcile()
    member = warm_member("acme", "bot")
    keeper.warm(create(store, "bot"))
    home = pool.router.placement(member)
    peer = next(a for a in pool.replicas if a != home)
    assert keeper.pinned_on(home) == keeper.pinned_on(peer) == 1  # counted by cache

    pool.router.set_serving(home, False)  # a drain
    keeper.reconcile()
    assert pool.router.placement(member) == peer
    assert sum(len(r.warms) for r in pool.replicas.values()) == 1  # no second prefill
    assert shared.pins == {pin_id("acme", "bot")}


def test_a_template_moves_to_a_cache_ranked_before_its_own_once_that_one_serves(store):
    pool = pool_of(FakeCache("a"), FakeCache("b"))
    keeper = TemplateKeeper(store, pool)
    member = warm_member("acme", "bot")
    first, second = pool.router.template_order(member)
    pool.router.set_serving(first, False)
    keeper.warm(create(store, "bot"))
    assert pool.router.placement(member) == second

    pool.router.set_serving(first, True)  # back from a restart
    keeper.reconcile()
    assert pool.router.placement(member) == first
    assert pool.replicas[first].cache.pins == {pin_id("acme", "bot")}
    assert not pool.replicas[second].cache.pins  # unpinned where it is no longer wanted


def test_a_template_warmed_while_a_round_runs_keeps_its_pin(store):
    """``warm`` runs on a request thread and a round on the keeper's: a pin
    taken after the round read the warm set is not the round's to unpin."""
    pool = pool_of(FakeCache("a"))
    keeper = TemplateKeeper(store, pool)
    replica = pool.replicas[REPLICAS[0]]
    real_info = replica.info

    def info_while_a_template_is_created(timeout_s=None):
        replica.info = real_info  # once
        keeper.warm(create(store, "bot"))  # after the round read the warm set
        return real_info(timeout_s)

    replica.info = info_while_a_template_is_created
    keeper.reconcile()
    keeper.reconcile()
    assert replica.cache.pins == {pin_id("acme", "bot")} and keeper.pinned_on(REPLICAS[0]) == 1


def test_a_round_between_a_warms_pin_and_its_warm_set_entry_keeps_the_pin(store, monkeypatch):
    pool = pool_of(FakeCache("a"))
    keeper = TemplateKeeper(store, pool)
    keeper.reconcile()  # learns the cache
    real_mark_warm = store.mark_warm

    def mark_warm_after_a_round(tenant, name):
        keeper.reconcile()  # the keeper's thread, while the pin is taken and not yet in the warm set
        real_mark_warm(tenant, name)

    monkeypatch.setattr(store, "mark_warm", mark_warm_after_a_round)
    keeper.warm(create(store, "bot"))
    monkeypatch.setattr(store, "mark_warm", real_mark_warm)
    keeper.reconcile()
    assert pool.replicas[REPLICAS[0]].cache.pins == {pin_id("acme", "bot")}
    assert keeper.pinned_on(REPLICAS[0]) == 1
