"""Keeps each template warm and pinned on one replica, and only while it lives.

A template's blocks are warmed (one prefill) and pinned in a daemon under the
pin id ``template:{tenant}/{name}``, on ONE replica: the first serving replica
of the template's rendezvous order whose daemon accepts the pin (its pin cap
may refuse). The router sends the template's requests there.

NOTE: one replica per template, not all of them: pins are capped per daemon,
so pinning everywhere would cap the fleet at one daemon's worth of templates
and spend N times the memory on each; placed once, N replicas hold N times as
many. A request that spills elsewhere (load bound) computes the template's
blocks there once and they stay cached, unpinned, while they are used.

Every ``interval_s`` the keeper:

- asks each serving replica for its cache id (``Info.cache_id``); a new id is
  a new, empty cache (its daemon restarted): nothing is pinned there any more;
- places every live template of the warm set: one not pinned on a serving
  replica is warmed on the first one that accepts it; one pinned on a replica
  that a replica earlier in its order (back from a restart, say) could take is
  moved there;
- unpins what it pinned on a replica and no longer wants there (moved, or the
  template is gone), and sweeps the warm set: a member whose template expired
  or was deleted is unpinned on every serving replica and dropped.

Every step is idempotent, so several gateways may share one Redis.
"""

from __future__ import annotations

import logging
import threading

import grpc

from gateway.replicas import ReplicaPool
from gateway.router import NoReplica
from gateway.templates import (
    StoreUnavailable,
    Template,
    TemplateNotFound,
    TemplateStore,
    split_warm_member,
    warm_member,
)
from gateway.tenants import tenant_salt
from kvd_api.engine.v1 import engine_pb2 as epb

log = logging.getLogger("gateway.keeper")

# A replica refusing a template with these may still take the next one.
_TRY_NEXT = frozenset({grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE})


def pin_id(tenant: str, name: str) -> str:
    return f"template:{warm_member(tenant, name)}"


class TemplateKeeper:
    """Args:
    store: the templates.
    pool: the replicas whose daemons hold the pins.
    interval_s: how often to reconcile.
    """

    def __init__(self, store: TemplateStore, pool: ReplicaPool, interval_s: float = 1.0) -> None:
        self.store = store
        self.pool = pool
        self.router = pool.router
        self.interval_s = interval_s
        self._cache_ids: dict[str, str] = {}  # replica -> the cache its pins below live in
        self._pinned: dict[str, set[str]] = {}  # replica -> warm members this gateway pinned there
        self._refused: dict[str, set[str]] = {}  # replica -> members its pin cap refused (this cache)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="template-keeper", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def pinned_on(self, address: str) -> int:
        with self._lock:
            return len(self._pinned.get(address, ()))

    # ------------------------------------------------------------- calls

    def warm(self, template: Template, timeout_s: float | None = None) -> int:
        """Places a template on the first serving replica that accepts it; returns the tokens pinned.

        Raises:
            grpc.RpcError: every replica refused (RESOURCE_EXHAUSTED past the
                pin caps) or failed; another error at once.
            NoReplica: no replica serves.
        """
        member = warm_member(template.tenant, template.name)
        order = self.router.template_order(member)
        if not order:
            raise NoReplica("no engine replica is serving")
        error: grpc.RpcError | None = None
        for address in order:
            try:
                return self._warm_on(address, template, timeout_s)
            except grpc.RpcError as err:
                if err.code() not in _TRY_NEXT:
                    raise
                error = err
        assert error is not None
        raise error

    def release(self, tenant: str, name: str) -> bool:
        """Unpins a template that is gone on every serving replica; False when
        one could not be told (the sweep tries again)."""
        member = warm_member(tenant, name)
        self.router.place(member, None)
        done = all([self._unpin(address, member) for address in self.router.serving()])
        if done:
            self.store.unmark_warm(member)
        return done

    def _warm_on(self, address: str, template: Template, timeout_s: float | None) -> int:
        member = warm_member(template.tenant, template.name)
        request = epb.WarmRequest(
            token_ids=template.token_ids,
            cache_salt=tenant_salt(template.tenant),
            pin_id=pin_id(template.tenant, template.name),
        )
        try:
            reply = self.pool.link(address).stub.Warm(request, timeout=timeout_s)
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                with self._lock:
                    self._refused.setdefault(address, set()).add(member)
            raise
        with self._lock:
            self._pinned.setdefault(address, set()).add(member)
        self.router.place(member, address)
        self.store.mark_warm(template.tenant, template.name)
        self.store.set_cached_tokens(template.tenant, template.name, reply.pinned_tokens)
        return reply.pinned_tokens

    def _unpin(self, address: str, member: str) -> bool:
        try:
            link = self.pool.link(address)
            link.stub.Unpin(epb.UnpinRequest(pin_id=f"template:{member}"), timeout=link.rpc_timeout_s)
        except KeyError:  # the replica left the pool, and its pins with it
            pass
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.NOT_FOUND:  # not pinned there: nothing to release
                log.warning("cannot unpin a template yet", extra={"template": member, "engine": address,
                                                                  "error": err.details()})  # fmt: skip
                return False
        with self._lock:
            self._pinned.get(address, set()).discard(member)
        return True

    # ------------------------------------------------------------- rounds

    def reconcile(self) -> None:
        """One round: note new caches, place live templates, unpin the rest."""
        try:
            members = self.store.warm_members()
            live = {m for m, alive in zip(members, self.store.live(members), strict=True) if alive}
            for address in self.router.serving():
                self._check_cache(address)
            for member in sorted(live):
                self._place(member)
            self._unpin_unwanted(live)
            for member in sorted(set(members) - live):
                if self.release(*split_warm_member(member)):
                    log.info("template gone; unpinned", extra={"template": member})
        except StoreUnavailable as exc:
            log.warning("cannot keep templates warm", extra={"error": str(exc)})

    def _check_cache(self, address: str) -> None:
        link = self.pool.link(address)
        try:
            cache_id = link.info(timeout_s=min(self.interval_s * 2, link.rpc_timeout_s)).cache_id
        except grpc.RpcError:
            return  # the monitor marks it down
        with self._lock:
            if not cache_id or self._cache_ids.get(address) == cache_id:
                return
            # A new, empty cache: nothing of ours is pinned there any more.
            self._cache_ids[address] = cache_id
            gone, self._pinned[address] = self._pinned.get(address, set()), set()
            self._refused[address] = set()
        for member in gone:
            if self.router.placement(member) == address:
                self.router.place(member, None)
        if gone:
            log.info("engine cache is new; re-warming its templates", extra={"engine": address})

    def _place(self, member: str) -> None:
        order = self.router.template_order(member)
        current = self.router.placement(member)
        # Only replicas ranked before the current one are worth a move.
        better = order[: order.index(current)] if current in order else order
        with self._lock:
            better = [a for a in better if member not in self._refused.get(a, ())]
        if not better:
            return
        try:
            template = self.store.get(*split_warm_member(member))
        except TemplateNotFound:
            return  # the sweep releases it
        for address in better:
            try:
                self._warm_on(address, template, timeout_s=60)
            except grpc.RpcError as err:
                log.warning("cannot warm a template", extra={"template": member, "engine": address,
                                                             "error": err.details()})  # fmt: skip
                continue
            log.info("template warmed and pinned", extra={"template": member, "engine": address})
            return

    def _unpin_unwanted(self, live: set[str]) -> None:
        for address in self.router.serving():
            with self._lock:
                pinned = set(self._pinned.get(address, ()))
            for member in pinned:
                if member not in live or self.router.placement(member) != address:
                    self._unpin(address, member)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.reconcile()
            except Exception:  # a bug in one round must not stop the keeper
                log.exception("template keeper round failed")
            self._stop.wait(self.interval_s)
