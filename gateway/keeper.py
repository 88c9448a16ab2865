"""Keeps templates warm and pinned on the engine, and only while they live.

A template's blocks are warmed (one prefill) and pinned in the daemon under
the pin id ``template:{tenant}/{name}``. Every ``interval_s`` the keeper:

- asks the engine which cache it is attached to (``Info.cache_id``); a new id
  is a new, empty cache (the daemon restarted), so every template in the warm
  set is warmed and pinned again;
- sweeps the warm set: a member whose template is gone (its TTL expired, or it
  was deleted while the engine was down) is unpinned and dropped.

Both steps are idempotent, so several gateways may share one Redis.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import grpc

from gateway.auth import tenant_salt
from gateway.engine_link import EngineLink
from gateway.templates import (
    StoreUnavailable,
    Template,
    TemplateNotFound,
    TemplateStore,
    split_warm_member,
    warm_member,
)
from kvd_api.engine.v1 import engine_pb2 as epb

log = logging.getLogger("gateway.keeper")


def pin_id(tenant: str, name: str) -> str:
    return f"template:{warm_member(tenant, name)}"


class TemplateKeeper:
    """Args:
    store: the templates.
    engine: the engine whose daemon holds the pins.
    interval_s: how often to reconcile.
    on_engine_health: told whether the engine answered, each round.
    """

    def __init__(
        self,
        store: TemplateStore,
        engine: EngineLink,
        interval_s: float = 1.0,
        on_engine_health: Callable[[bool], None] = lambda up: None,
    ) -> None:
        self.store = store
        self.engine = engine
        self.interval_s = interval_s
        self.on_engine_health = on_engine_health
        self.warmed_cache_id = ""  # the engine cache every warm template is pinned in
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="template-keeper", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    # ------------------------------------------------------------- calls

    def warm(self, template: Template, timeout_s: float | None = None) -> int:
        """Warms and pins a template; returns the tokens pinned.

        Raises:
            grpc.RpcError: the engine's refusal (RESOURCE_EXHAUSTED past the
                pin cap) or failure.
        """
        reply = self.engine.stub.Warm(
            epb.WarmRequest(
                token_ids=template.token_ids,
                cache_salt=tenant_salt(template.tenant),
                pin_id=pin_id(template.tenant, template.name),
            ),
            timeout=timeout_s,
        )
        self.store.mark_warm(template.tenant, template.name)
        self.store.set_cached_tokens(template.tenant, template.name, reply.pinned_tokens)
        return reply.pinned_tokens

    def release(self, tenant: str, name: str) -> bool:
        """Unpins a template that is gone; False when the engine could not be
        told (the sweep tries again)."""
        try:
            self.engine.stub.Unpin(epb.UnpinRequest(pin_id=pin_id(tenant, name)), timeout=self.engine.rpc_timeout_s)
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.NOT_FOUND:  # not pinned there: nothing to release
                log.warning("cannot unpin a template yet", extra={"template": name, "error": err.details()})
                return False
        self.store.unmark_warm(warm_member(tenant, name))
        return True

    # ------------------------------------------------------------- rounds

    def reconcile(self) -> None:
        """One round: re-warm after a cache change, then sweep."""
        try:
            info = self.engine.info(timeout_s=min(self.interval_s * 2, self.engine.rpc_timeout_s))
        except grpc.RpcError:
            self.on_engine_health(False)
            return
        self.on_engine_health(bool(info.cache_id))
        try:
            if info.cache_id and info.cache_id != self.warmed_cache_id and self._rewarm_all():
                self.warmed_cache_id = info.cache_id
            self._sweep()
        except StoreUnavailable as exc:
            log.warning("cannot keep templates warm", extra={"error": str(exc)})

    def _rewarm_all(self) -> bool:
        members = self.store.warm_members()
        ok = True
        for member, alive in zip(members, self.store.live(members), strict=True):
            if not alive:
                continue  # the sweep unpins it
            tenant, name = split_warm_member(member)
            try:
                self.warm(self.store.get(tenant, name), timeout_s=60)
            except TemplateNotFound:
                continue
            except grpc.RpcError as err:
                ok = False
                log.warning("cannot re-warm a template", extra={"template": member, "error": err.details()})
        if members:
            log.info("templates warmed and pinned", extra={"templates": len(members), "complete": ok})
        return ok

    def _sweep(self) -> None:
        members = self.store.warm_members()
        for member, alive in zip(members, self.store.live(members), strict=True):
            if not alive:
                tenant, name = split_warm_member(member)
                if self.release(tenant, name):
                    log.info("template gone; unpinned", extra={"template": member})

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.reconcile()
            except Exception:  # a bug in one round must not stop the keeper
                log.exception("template keeper round failed")
            self._stop.wait(self.interval_s)
