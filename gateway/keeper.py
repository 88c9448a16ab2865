"""Keeps each template warm and pinned in one cache, and only while it lives.

A template's blocks are warmed (one prefill) and pinned in a daemon under the
pin id ``template:{tenant}/{name}``, in ONE cache: through the first serving
replica of the template's rendezvous order whose daemon accepts the pin (its
pin cap may refuse). The router sends the template's requests there. Pins
live in daemons, so the keeper counts them by cache (the ``cache_id`` each
replica's ``Info`` reports), not by replica: engines sharing a daemon share
its pins, and a template whose replica drains stays pinned while another
replica of the same cache serves (it only becomes the template's home).

NOTE: one replica per template, not all of them: pins are capped per daemon,
so pinning everywhere would cap the fleet at one daemon's worth of templates
and spend N times the memory on each; placed once, N replicas hold N times as
many. A request that spills elsewhere (load bound) computes the template's
blocks there once and they stay cached, unpinned, while they are used.

Every ``interval_s`` the keeper:

- asks each serving replica for its cache id (``Info.cache_id``; the router
  keeps it): a cache no serving replica reports any more is gone (its daemon
  restarted: a new id, a new and empty cache), and so are its pins;
- places every live template of the warm set: one not pinned in a serving
  cache is warmed through the first replica that accepts it; one pinned in a
  cache that a cache earlier in its order (back from a restart, say) could
  take is moved there;
- unpins what it pinned in a cache and no longer wants there (moved, or the
  template is gone), and sweeps the warm set: a member whose template expired
  or was deleted is unpinned in every serving cache and dropped.

Every step is idempotent, so several gateways may share one Redis.
"""

from __future__ import annotations

import logging
import threading
import time

import grpc

from gateway.replicas import ReplicaPool, engine_status
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
        self._pinned: dict[str, set[str]] = {}  # cache id -> warm members this gateway pinned there
        self._refused: dict[str, set[str]] = {}  # cache id -> members its pin cap refused
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="template-keeper", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def pinned_on(self, address: str) -> int:
        """Templates pinned in ``address``'s cache."""
        cache_id = self.router.cache_of(address)
        with self._lock:
            return len(self._pinned.get(cache_id, ())) if cache_id else 0

    # ------------------------------------------------------------- calls

    def warm(self, template: Template, timeout_s: float | None = None) -> int:
        """Places a template on the first serving replica that accepts it; returns the tokens pinned.

        During a drain or a restart (no replica serves, or every one refused
        with UNAVAILABLE, but one served lately) waits for one to come back,
        as a request does (``ReplicaPool.await_serving``), within ``timeout_s``.

        Raises:
            grpc.RpcError: every replica refused (RESOURCE_EXHAUSTED past the
                pin caps) or failed; another error at once.
            NoReplica: no replica serves.
        """
        member = warm_member(template.tenant, template.name)
        give_up_at = time.monotonic() + (self.pool.replica_wait_s if timeout_s is None else timeout_s)
        tried: dict[str, int] = {}
        error: grpc.RpcError | None = None
        while True:
            refused = self.router.refusers(tried)
            for address in [a for a in self.router.template_order(member) if a not in refused]:
                tried[address] = self.router.comebacks(address)
                try:
                    left = None if timeout_s is None else give_up_at - time.monotonic()
                    return self._warm_on(address, template, left)
                except grpc.RpcError as err:
                    status = engine_status(err)
                    if status not in _TRY_NEXT:
                        raise
                    if status == grpc.StatusCode.UNAVAILABLE:
                        self.pool.mark_down(address)
                    error = err
            full = error is not None and engine_status(error) != grpc.StatusCode.UNAVAILABLE
            if full or not self.pool.await_serving(tried, give_up_at - time.monotonic()):
                if error is not None:
                    raise error
                raise NoReplica("no engine replica is serving")

    def release(self, tenant: str, name: str) -> bool:
        """Unpins a template that is gone in every serving cache; False when
        one could not be told (the sweep tries again)."""
        member = warm_member(tenant, name)
        self.router.place(member, None)
        done = all([self._unpin(cache_id, member) for cache_id in self.router.serving_by_cache()])
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
        link = self.pool.link(address)
        cache_id = self.router.cache_of(address) or self._learn_cache(address)
        try:
            reply = link.stub.Warm(request, timeout=timeout_s)
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                with self._lock:
                    self._refused.setdefault(cache_id, set()).add(member)
            raise
        # NOTE: into the warm set before into ``_pinned``: a round unpins what it
        # finds pinned and not in the warm set it read, so a pin must never be
        # visible there before its member is (see ``reconcile``). Recorded even
        # if marking fails, so that a later round unpins it. Placed first, so
        # that a round seeing the member warm does not warm it a second time.
        self.router.place(member, address)
        try:
            self.store.mark_warm(template.tenant, template.name)
        finally:
            with self._lock:
                self._pinned.setdefault(cache_id, set()).add(member)
        self.store.set_cached_tokens(template.tenant, template.name, reply.pinned_tokens)
        return reply.pinned_tokens

    def _unpin(self, cache_id: str, member: str) -> bool:
        """Unpins ``member`` in a cache through one of its serving replicas;
        False when none could be told (a later round tries again)."""
        replicas = self.router.serving_by_cache().get(cache_id, [])
        if not replicas:
            return False
        try:
            link = self.pool.link(replicas[0])
            link.stub.Unpin(epb.UnpinRequest(pin_id=f"template:{member}"), timeout=link.rpc_timeout_s)
        except KeyError:  # the replica left the pool meanwhile
            return False
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.NOT_FOUND:  # not pinned there: nothing to release
                log.warning("cannot unpin a template yet", extra={"template": member, "engine": replicas[0],
                                                                  "error": err.details()})  # fmt: skip
                return False
        with self._lock:
            self._pinned.get(cache_id, set()).discard(member)
        return True

    # ------------------------------------------------------------- rounds

    def reconcile(self) -> None:
        """One round: note new caches, place live templates, unpin the rest."""
        # Only pins taken before the warm set is read may be unpinned as
        # unwanted: a template created meanwhile (``warm`` runs on request
        # threads) is pinned after this read and is not in it.
        with self._lock:
            pinned_before = {cache_id: set(members) for cache_id, members in self._pinned.items()}
        try:
            members = self.store.warm_members()
            live = {m for m, alive in zip(members, self.store.live(members), strict=True) if alive}
            for address in self.router.serving():
                self._learn_cache(address)
            self._forget_gone_caches()
            for member in sorted(live):
                self._place(member)
            self._unpin_unwanted(live, pinned_before)
            for member in sorted(set(members) - live):
                if self.release(*split_warm_member(member)):
                    log.info("template gone; unpinned", extra={"template": member})
        except StoreUnavailable as exc:
            log.warning("cannot keep templates warm", extra={"error": str(exc)})

    def _learn_cache(self, address: str) -> str:
        """Asks ``address`` which cache it is attached to and tells the router ("": unknown)."""
        try:
            link = self.pool.link(address)
            cache_id = link.info(timeout_s=min(self.interval_s * 2, link.rpc_timeout_s)).cache_id
        except (KeyError, grpc.RpcError):
            return ""  # the monitor marks it down
        if cache_id and cache_id != self.router.cache_of(address):
            self.router.set_cache(address, cache_id)
        return cache_id

    def _forget_gone_caches(self) -> None:
        """A cache no replica reports any more is gone (a restarted daemon has
        a new one; a replica that left the pool took its cache along), and its
        pins with it; its templates are placed again (re-warmed) this round.
        A replica that is only down keeps its cache: its pins are still there
        when it comes back, and are unpinned then if unwanted."""
        known = self.router.known_caches()
        with self._lock:
            gone = [cache_id for cache_id in self._pinned if cache_id not in known]
            members = set().union(*(self._pinned.pop(cache_id) for cache_id in gone))
            for cache_id in gone:
                self._refused.pop(cache_id, None)
        for member in members:  # its replica's address may now name the new, empty cache
            self.router.place(member, None)
        if gone:
            log.info("engine caches gone; re-warming their templates", extra={"templates": len(members)})

    def _place(self, member: str) -> None:
        order = self.router.template_order(member)
        current = self.router.placement(member)
        current_cache = self.router.cache_of(current)
        if current_cache and current not in order:
            # Its replica stopped serving (a drain, say): a replica of the same
            # cache holds the same pinned blocks; it becomes the home.
            peer = next((a for a in order if self.router.cache_of(a) == current_cache), None)
            if peer is not None:
                self.router.place(member, peer)
                current = peer
        # Only caches ranked before the current one are worth a move.
        better = order[: order.index(current)] if current in order else order
        with self._lock:
            better = [
                a for a in better
                if self.router.cache_of(a) != current_cache
                and member not in self._refused.get(self.router.cache_of(a), ())
            ]  # fmt: skip
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

    def _unpin_unwanted(self, live: set[str], pinned_before: dict[str, set[str]]) -> None:
        for cache_id in self.router.serving_by_cache():
            with self._lock:
                pinned = self._pinned.get(cache_id, set()) & pinned_before.get(cache_id, set())
            for member in pinned:
                if member not in live or self.router.cache_of(self.router.placement(member)) != cache_id:
                    self._unpin(cache_id, member)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.reconcile()
            except Exception:  # a bug in one round must not stop the keeper
                log.exception("template keeper round failed")
            self._stop.wait(self.interval_s)
