"""The daemon: sessions and their leases, and every RPC's work, behind one lock.

Every public method is one RPC's worth of work in plain Python types; the
gRPC layer only translates. Keeping the lock here (and nothing below it
thread-aware) means the pool and manager stay simple and fast. What it holds
lives in its own modules: the cache (``kvd.cache``), the sessions
(``kvd.session``), lapsed sessions whose blocks are held back
(``kvd.quarantine``), the event subscribers (``kvd.events``), the counters
(``kvd.stats``).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

from kvd.cache import CachedPrefix, InspectedBlock, KVCache
from kvd.common.identity import ModelIdentity
from kvd.common.layout import CacheLayout
from kvd.common.memory import KVMemory
from kvd.common.process_identity import ProcessIdentity
from kvd.config import DaemonConfig
from kvd.errors import PreconditionError
from kvd.events import EventBatch, EventHub, EventsSnapshot
from kvd.marks import Marker
from kvd.quarantine import Quarantine
from kvd.scheduler import run_step
from kvd.session import Session, SessionRegistry
from kvd.stats import Stats, collect_stats
from kvd_api.daemon.v1 import daemon_pb2 as pb

log = logging.getLogger("kvd.daemon")

Clock = Callable[[], float]


class Attachment(NamedTuple):
    """A new session and the cache's memory its engine maps."""

    session: Session
    memory: KVMemory


class Daemon:
    """The KV-cache daemon's whole state. Thread-safe.

    Args:
        config: its settings; with ``config.model_layout`` the cache is made now,
            otherwise at the first attach that brings a layout.
        clock: monotonic seconds for leases and cache marks' expiries (tests
            pass one they advance).
    """

    def __init__(self, config: DaemonConfig, clock: Clock = time.monotonic) -> None:
        self.config = config
        self.lock = threading.Lock()
        self.sessions = SessionRegistry(config.lease_s, clock)
        self.quarantine = Quarantine(config.quarantine_s)
        self.events = EventHub(self._cached_hashes)
        self.cache: KVCache | None = None
        self._marker: Marker | None = None  # pins requests' cache marks (kvd.marks), with the cache
        self._clock = clock
        self._reaper: threading.Thread | None = None
        self._stop_reaper = threading.Event()
        if config.model_layout is not None:
            self._create_cache(config.model_layout)

    # -------------------------------------------------------------- cache

    def _create_cache(self, model_layout: CacheLayout) -> KVCache:
        self.cache = KVCache(self.config, model_layout, self.lock, self.events.publish)
        self._marker = Marker(self.cache.pins, self._clock, self.cache.manager.block_size)
        self.events.new_incarnation(self.cache.cache_id)
        return self.cache

    def _cache(self) -> KVCache:
        if self.cache is None:
            raise PreconditionError("the daemon has no cache yet: an engine must attach with its model's layout")
        return self.cache

    @property
    def layout(self) -> CacheLayout | None:
        return None if self.cache is None else self.cache.layout

    @property
    def cache_id(self) -> str:
        """The cache's identity ("" before it exists); a new cache has a new one."""
        return "" if self.cache is None else self.cache.cache_id

    def cache_memory(self) -> KVMemory | None:
        """The cache's memory and how to map it; None before the cache exists."""
        return None if self.cache is None else self.cache.memory

    # ----------------------------------------------------------- sessions

    def attach(
        self,
        client_name: str,
        model_layout: CacheLayout | None,
        process: ProcessIdentity | None = None,
        model: ModelIdentity | None = None,
    ) -> Attachment:
        """Opens a session, creating the cache from ``model_layout`` if none exists.
        ``process``: the engine's, checked if the session's lease lapses;
        ``model``: the engine's model, which must be the cache's (kvd.common.identity).

        Raises:
            PreconditionError: no cache and no layout, a layout that does not
                match the existing cache, or another model than the cache's.
        """
        with self.lock:
            if self.cache is None:
                if model_layout is None:
                    raise PreconditionError("the daemon has no cache yet: attach with the model's layout")
                self._create_cache(model_layout)
            elif model_layout is not None and not self.cache.layout.same_model(model_layout):
                raise PreconditionError(
                    f"the model's layout ({model_layout.describe()}) does not match the daemon's cache "
                    f"({self.cache.layout.describe()}); restart the daemon or use a matching model"
                )
            if model is not None:
                self.cache.admit_model(model)
            session = self.sessions.open(client_name, process=process)
            log.info("session attached", extra={"session": session.session_id, "client": client_name})
            return Attachment(session, self.cache.memory)

    def heartbeat(self, session_id: str) -> None:
        with self.lock:
            self.sessions.get(session_id)

    def detach(self, session_id: str) -> int:
        """Ends a session, or a lapsed one's quarantine (its engine detaches
        only once it cannot write); returns the requests it released."""
        with self.lock:
            if session_id in self.quarantine:
                return self._end_quarantine(session_id, "its engine detached")
            return self._close_session(session_id, "detached")

    def reap_expired(self) -> list[str]:
        """Quarantines sessions whose heartbeat lapsed, releases the
        quarantined ones that can no longer write, and unpins the cache marks
        whose time is up; returns the lapsed ids."""
        with self.lock:
            now = self._clock()
            expired = self.sessions.expired()
            for session_id in expired:
                self._lapse(session_id, now)
            for session_id, why in self.quarantine.due(now):
                self._end_quarantine(session_id, why)
            if self.cache is not None and (unpinned := self.cache.pins.expire(now)):
                log.info("cache marks expired", extra={"unpinned": unpinned, "pins": self.cache.pins.num_pins})
            return expired

    def start(self) -> None:
        """Starts the lease reaper: a session not heard from for ``lease_s`` is released."""
        if self._reaper is not None:
            return
        self._stop_reaper.clear()
        self._reaper = threading.Thread(target=self._reap_until_stopped, name="kvd-reaper", daemon=True)
        self._reaper.start()

    def stop(self) -> None:
        """Stops the lease reaper (sessions stay as they are)."""
        if self._reaper is None:
            return
        self._stop_reaper.set()
        self._reaper.join()
        self._reaper = None

    def _reap_until_stopped(self) -> None:
        # NOTE: a quarter of the lease between passes: a dead engine's blocks
        # come back at most 1.25 leases after its last heartbeat. At most a
        # second: a cache mark's pin outlives its expiry by less than that.
        interval_s = min(1.0, self.config.lease_s / 4)
        while not self._stop_reaper.wait(interval_s):
            self.reap_expired()

    def _lapse(self, session_id: str, now: float) -> None:
        """A lease lapsed: the session's requests keep their blocks, out of
        reach, until its engine cannot write them (kvd/quarantine.py)."""
        session = self.sessions.remove(session_id)
        if self.cache is None:
            return
        self.quarantine.hold(session, now)
        log.warning(
            "session lease expired; its blocks are quarantined until its engine detaches or is gone",
            extra={"session": session_id, "blocks": session.num_blocks_held},
        )

    def _end_quarantine(self, session_id: str, why: str) -> int:
        assert self.cache is not None, "a quarantined session outlived its cache"
        released = self.quarantine.release(session_id, self.cache.manager)
        self._publish()
        log.info("quarantined session released", extra={"session": session_id, "why": why, "requests": released})
        return released

    def _close_session(self, session_id: str, why: str) -> int:
        if self.cache is None:  # no cache: the session holds nothing
            self.sessions.sessions.pop(session_id, None)
            return 0
        released = self.sessions.close(session_id, self.cache.manager)
        self._publish()
        log.info("session closed", extra={"session": session_id, "why": why, "released_requests": released})
        return released

    # --------------------------------------------------------------- work

    def step(self, session_id: str, msg: pb.StepRequest) -> pb.StepResponse:
        """One engine step: its reports applied, its next work scheduled (kvd/scheduler.py)."""
        with self.lock:
            cache = self._cache()
            session = self.sessions.get(session_id)
            block_cap = self.sessions.fair_share(session, cache.pool.num_blocks)
            reply = run_step(cache.manager, session, msg, block_cap, self._marker)
            if cache.copier is not None:
                copies = cache.manager.take_copies()
                # NOTE: the blocks copied out were written by this engine's
                # forwards (done, by the Step contract; the wait makes it so on
                # the device too); the blocks copied into may still be read or
                # written by a forward that was in flight when they were given
                # up (kvd.session: unsettled sessions).
                cache.copier.copy_out(copies.offloads, after=[msg.forward_event] if msg.forward_event else [])
                cache.copier.copy_in(copies.swap_ins, after=self.sessions.unsettled_forwards())
                reply.copy_events.extend(cache.copier.pending_events())
            self._publish()
            return reply

    def wait_for_copies(self, timeout_s: float = 60.0) -> bool:
        """Waits until every tier copy submitted so far finished (tests, reset)."""
        return self.cache is None or self.cache.wait_for_copies(timeout_s)

    def cached_prefix(self, token_ids: Sequence[int], cache_salt: bytes, extra_keys: Sequence[bytes]) -> CachedPrefix:
        """What each tier holds of ``token_ids``' leading blocks: the hashes of
        those cached on the device, how many blocks after them the host tier
        holds, and how many after those the disk tier holds."""
        with self.lock:
            cache = self._cache()
            return cache.cached_prefix(cache.block_hashes(token_ids, cache_salt, extra_keys))

    def pin(self, pin_id: str, token_ids: Sequence[int], cache_salt: bytes, extra_keys: Sequence[bytes]) -> int:
        """Pins the cached prefix of ``token_ids``; returns the blocks pinned."""
        if not token_ids:
            raise ValueError("token_ids must not be empty")
        with self.lock:
            cache = self._cache()
            return len(cache.pins.pin(pin_id, cache.block_hashes(token_ids, cache_salt, extra_keys)))

    def unpin(self, pin_id: str) -> int:
        with self.lock:
            return self._cache().pins.unpin(pin_id)

    def reset(self) -> int:
        """Empties every tier (cache marks' pins go too; a named pin refuses
        it); returns the device blocks whose content was dropped."""
        self.wait_for_copies()
        with self.lock:
            cleared = self._cache().reset()
            self._publish()
            return cleared

    def inspect_block(self, block_id: int) -> InspectedBlock:
        """A block's metadata and the sha256 of its bytes, read by the daemon."""
        with self.lock:
            return self._cache().inspect_block(block_id)

    def stats(self) -> Stats:
        with self.lock:
            return collect_stats(self.cache, self.sessions, self.quarantine)

    def mark_counts(self) -> tuple[int, int]:
        """Cache marks reported pinned and refused so far (metrics)."""
        with self.lock:
            marker = self._marker
            return (0, 0) if marker is None else (marker.num_pinned, marker.num_refused)

    # ------------------------------------------------------------- events

    def subscribe(self) -> tuple[queue.SimpleQueue[EventBatch | None], EventsSnapshot]:
        """What is cached now, and a queue that receives every later batch of
        block events (None: the end). Taken under the lock every publisher
        holds, so nothing falls between the two."""
        with self.lock:
            return self.events.subscribe()

    def unsubscribe(self, subscriber: queue.SimpleQueue) -> None:
        self.events.unsubscribe(subscriber)

    def _cached_hashes(self) -> tuple[list[bytes], list[bytes], list[bytes]]:
        """Every cached block's hash per tier (device, host, disk); under the lock."""
        if self.cache is None:
            return [], [], []
        host = list(self.cache.host.cached) if self.cache.host is not None else []
        disk = self.cache.disk.store.hashes() if self.cache.disk is not None else []
        return list(self.cache.pool.cached), host, disk

    def _publish(self) -> None:
        """Hands this call's events to every subscriber (under the lock)."""
        if self.cache is not None:
            self.events.publish(self.cache.pool.take_events())

    def close(self) -> None:
        self.stop()
        if self.cache is not None:
            self.cache.stop_copies()
        with self.lock:
            self.events.close()
            if self.cache is not None:
                self.cache.close()
