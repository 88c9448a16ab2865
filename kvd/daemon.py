"""The daemon's state, behind one lock: memory, pool, sessions, pins.

Every public method is one RPC's worth of work in plain Python types; the
gRPC layer only translates. Keeping the lock here (and nothing below it
thread-aware) means the pool and manager stay simple and fast.
"""

from __future__ import annotations

import gc
import hashlib
import logging
import queue
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvd.block import Block
from kvd.block_pool import BlockEvent, BlockPool
from kvd.cache_manager import KVCacheManager
from kvd.errors import PreconditionError
from kvd.hashing import encode_extra_keys, sequence_block_hashes
from kvd.host_tier import HostTier
from kvd.layout import CacheLayout
from kvd.memory import KVMemory
from kvd.offload import Offload, SwapIn, TierCopier
from kvd.pins import PinRegistry
from kvd.session import Session, SessionRegistry
from kvd.step import StepInput, StepOutput, run_step

log = logging.getLogger("kvd.daemon")


@dataclass(frozen=True)
class DaemonConfig:
    """Settings of one daemon; the CLI builds it from flags and environment.

    Attributes:
        block_size: tokens per block.
        num_blocks: blocks in the cache; when 0, as many as
            ``memory_budget_bytes`` holds.
        memory_budget_bytes: the cache's size when ``num_blocks`` is 0.
        device: ``cpu`` (shared-memory file) or ``cuda[:N]`` (CUDA IPC).
        shm_dir: where the shared-memory file lives.
        max_pinned_fraction: the share of blocks pins may hold.
        lease_s: a session not heard from for this long is released.
        enable_caching: index committed blocks (off: every lookup misses).
        model_layout: create the cache at start with this layout (its
            ``block_size`` is ignored); otherwise at the first attach.
        host_num_blocks: blocks of the host-memory tier; when 0, as many as
            ``host_memory_budget_bytes`` holds (0: no host tier).
    """

    block_size: int = 16
    num_blocks: int = 0
    memory_budget_bytes: int = 1 << 30
    device: str = "cpu"
    shm_dir: str = "/dev/shm"
    max_pinned_fraction: float = 0.5
    lease_s: float = 5.0
    enable_caching: bool = True
    model_layout: CacheLayout | None = None
    host_num_blocks: int = 0
    host_memory_budget_bytes: int = 0

    def __post_init__(self) -> None:
        if self.host_num_blocks < 0 or self.host_memory_budget_bytes < 0:
            raise ValueError("the host tier's size must be >= 0")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {self.num_blocks}")
        if self.num_blocks == 0 and self.memory_budget_bytes < 1:
            raise ValueError(f"memory budget must be > 0, got {self.memory_budget_bytes}")
        if not 0.0 <= self.max_pinned_fraction <= 1.0:
            raise ValueError(f"max_pinned_fraction must be in [0, 1], got {self.max_pinned_fraction}")
        if self.lease_s <= 0:
            raise ValueError(f"lease_s must be > 0, got {self.lease_s}")


@dataclass(frozen=True)
class EventsSnapshot:
    """The cached blocks' hashes per tier, as of the batch numbered ``sequence``."""

    incarnation: str
    sequence: int
    device: list[bytes]
    host: list[bytes]


@dataclass(frozen=True)
class Stats:
    num_blocks: int
    num_free_blocks: int
    num_used_blocks: int
    num_pinned_blocks: int
    num_cached_blocks: int
    max_pinned_blocks: int
    evictions: int
    query_tokens: int
    hit_tokens: int
    num_sessions: int
    num_requests: int
    num_pins: int
    num_host_blocks: int = 0
    num_host_free_blocks: int = 0
    num_host_cached_blocks: int = 0
    num_copying_blocks: int = 0
    num_host_blocks_read: int = 0
    host_hit_tokens: int = 0
    host_evictions: int = 0
    bytes_to_host: int = 0
    bytes_from_host: int = 0
    copy_to_host_seconds: float = 0.0
    copy_from_host_seconds: float = 0.0
    copy_batches_to_host: int = 0
    copy_batches_from_host: int = 0


class Daemon:
    """The KV-cache daemon's whole state. Thread-safe."""

    def __init__(self, config: DaemonConfig) -> None:
        self.config = config
        self.lock = threading.Lock()
        self.sessions = SessionRegistry(config.lease_s)
        self.memory: KVMemory | None = None
        self.cache_id = ""  # set when the cache is created; new cache, new id
        self.pool: BlockPool | None = None
        self.manager: KVCacheManager | None = None
        self.pins: PinRegistry | None = None
        self.host: HostTier | None = None
        self.copier: TierCopier | None = None
        self._subscribers: list[queue.SimpleQueue] = []
        self._sequence = 0  # of the last batch of events published
        if config.model_layout is not None:
            self._create_cache(config.model_layout)

    # -------------------------------------------------------------- cache

    def _create_cache(self, model_layout: CacheLayout) -> None:
        cfg = self.config
        layout = CacheLayout(
            model_layout.num_layers,
            model_layout.num_kv_heads,
            model_layout.head_dim,
            cfg.block_size,
            model_layout.dtype,
        )
        num_blocks = cfg.num_blocks or layout.num_blocks_for(cfg.memory_budget_bytes)
        self.memory = KVMemory(layout, num_blocks, cfg.device, cfg.shm_dir)
        self.cache_id = uuid.uuid4().hex
        self.pool = BlockPool(num_blocks, enable_caching=cfg.enable_caching, record_events=True)
        num_host_blocks = cfg.host_num_blocks or (cfg.host_memory_budget_bytes // layout.block_bytes)
        if num_host_blocks and cfg.enable_caching:
            self.host = HostTier(num_host_blocks, record=self.pool.record)
            self.copier = TierCopier(self.memory.tensor, num_host_blocks, self.lock, self._offloaded, self._swapped_in)
        self.manager = KVCacheManager(self.pool, cfg.block_size, self.host)
        self.pins = PinRegistry(self.pool, int(num_blocks * cfg.max_pinned_fraction))
        # NOTE: the pool's blocks live as long as the daemon; frozen, the cyclic
        # garbage collector stops scanning them (~10 ms per full pass at 128k
        # blocks, which would land inside some unlucky Step).
        gc.freeze()
        log.info(
            "cache created",
            extra={
                "layout": layout.describe(),
                "num_blocks": num_blocks,
                "bytes": self.memory.nbytes,
                "device": cfg.device,
                "host_blocks": num_host_blocks if self.host else 0,
            },
        )

    def _ready(self) -> tuple[BlockPool, KVCacheManager, PinRegistry]:
        if self.pool is None or self.manager is None or self.pins is None:
            raise PreconditionError("the daemon has no cache yet: an engine must attach with its model's layout")
        return self.pool, self.manager, self.pins

    @property
    def layout(self) -> CacheLayout | None:
        return None if self.memory is None else self.memory.layout

    def describe(self) -> KVMemory | None:
        return self.memory

    # ----------------------------------------------------------- sessions

    def attach(self, client_name: str, model_layout: CacheLayout | None) -> tuple[Session, KVMemory]:
        """Opens a session, creating the cache from ``model_layout`` if none exists.

        Raises:
            PreconditionError: no cache and no layout, or a layout that does
                not match the existing cache.
        """
        with self.lock:
            if self.memory is None:
                if model_layout is None:
                    raise PreconditionError("the daemon has no cache yet: attach with the model's layout")
                self._create_cache(model_layout)
            elif model_layout is not None and not self.memory.layout.same_model(model_layout):
                raise PreconditionError(
                    f"the model's layout ({model_layout.describe()}) does not match the daemon's cache "
                    f"({self.memory.layout.describe()}); restart the daemon or use a matching model"
                )
            session = self.sessions.open(client_name)
            assert self.memory is not None
            log.info("session attached", extra={"session": session.session_id, "client": client_name})
            return session, self.memory

    def heartbeat(self, session_id: str) -> None:
        with self.lock:
            self.sessions.get(session_id)

    def detach(self, session_id: str) -> int:
        with self.lock:
            return self._close_session(session_id, "detached")

    def reap_expired(self) -> list[str]:
        """Releases sessions whose heartbeat lapsed; returns their ids."""
        with self.lock:
            expired = self.sessions.expired()
            for session_id in expired:
                self._close_session(session_id, "lease expired")
            return expired

    def _close_session(self, session_id: str, why: str) -> int:
        manager = self.manager
        if manager is None:  # no cache: the session holds nothing
            self.sessions.sessions.pop(session_id, None)
            return 0
        released = self.sessions.close(session_id, manager)
        self._publish()
        log.info("session closed", extra={"session": session_id, "why": why, "released_requests": released})
        return released

    # --------------------------------------------------------------- work

    def step(self, session_id: str, step: StepInput) -> StepOutput:
        with self.lock:
            _, manager, _ = self._ready()
            out = run_step(manager, self.sessions.get(session_id), step)
            if self.copier is not None:
                offloads, swap_ins = manager.take_copies()
                self.copier.copy_out(offloads)
                self.copier.copy_in(swap_ins)
                out.copy_events = self.copier.pending_events()
            self._publish()
            return out

    # Called by the copier's worker, under the lock.
    def _offloaded(self, offloads: Sequence[Offload]) -> None:
        assert self.pool is not None and self.host is not None
        for block, slot in offloads:
            self.pool.copy_finished(block)
            self.host.written(slot)
        self._publish()

    def _swapped_in(self, swap_ins: Sequence[SwapIn]) -> None:
        assert self.host is not None
        self.host.end_read([slot for slot, _ in swap_ins])

    def drain_copies(self, timeout_s: float = 60.0) -> bool:
        """Waits until every tier copy submitted so far finished (tests, reset)."""
        return self.copier is None or self.copier.drain(timeout_s)

    def lookup(
        self, token_ids: Sequence[int], cache_salt: bytes, extra_keys: Sequence[bytes]
    ) -> tuple[list[bytes], int]:
        """The hashes of the leading blocks of ``token_ids`` cached on the
        device, and how many blocks after them the host tier holds."""
        with self.lock:
            pool, manager, _ = self._ready()
            hashes = self._hashes(token_ids, cache_salt, extra_keys)
            on_device = len(pool.match_prefix(hashes))
            return hashes[:on_device], len(manager.match_tiers(hashes)) - on_device

    def pin(self, pin_id: str, token_ids: Sequence[int], cache_salt: bytes, extra_keys: Sequence[bytes]) -> int:
        """Pins the cached prefix of ``token_ids``; returns the blocks pinned."""
        if not token_ids:
            raise ValueError("token_ids must not be empty")
        with self.lock:
            _, _, pins = self._ready()
            return len(pins.pin(pin_id, self._hashes(token_ids, cache_salt, extra_keys)))

    def unpin(self, pin_id: str) -> int:
        with self.lock:
            _, _, pins = self._ready()
            return pins.unpin(pin_id)

    def reset(self) -> int:
        """Empties both tiers; returns the device blocks whose content was dropped."""
        self.drain_copies()
        with self.lock:
            pool, _, _ = self._ready()
            try:
                if self.host is not None and self.host.num_in_copy:
                    raise ValueError("tier copies are in flight")
                cleared = pool.reset()
            except ValueError as exc:
                raise PreconditionError(f"cannot reset the cache: {exc}") from None
            if self.host is not None:
                self.host.clear()
            self._publish()
            return cleared

    def inspect_block(self, block_id: int) -> tuple[Block, bytes]:
        """A block's metadata and the sha256 of its bytes, read by the daemon."""
        with self.lock:
            pool, _, _ = self._ready()
            if not 0 <= block_id < pool.num_blocks:
                raise ValueError(f"block_id must be in [0, {pool.num_blocks}), got {block_id}")
            assert self.memory is not None
            data = self.memory.tensor[block_id].contiguous().cpu()
            digest = hashlib.sha256(data.view(torch.uint8).numpy().tobytes()).digest()
            return pool.blocks[block_id], digest

    def stats(self) -> Stats:
        with self.lock:
            pool, manager, pins = self.pool, self.manager, self.pins
            num_blocks = pool.num_blocks if pool else 0
            free = pool.num_free if pool else 0
            return Stats(
                num_blocks=num_blocks,
                num_free_blocks=free,
                num_used_blocks=num_blocks - free,
                num_pinned_blocks=pins.num_pinned_blocks if pins else 0,
                num_cached_blocks=len(pool.cached) if pool else 0,
                max_pinned_blocks=pins.max_pinned_blocks if pins else 0,
                evictions=pool.num_evictions if pool else 0,
                query_tokens=manager.query_tokens if manager else 0,
                hit_tokens=manager.hit_tokens if manager else 0,
                num_sessions=len(self.sessions.sessions),
                num_requests=self.sessions.num_requests,
                num_pins=len(pins.pins) if pins else 0,
                **self._tier_stats(),
            )

    def _tier_stats(self) -> dict[str, int | float]:
        host, copier, pool = self.host, self.copier, self.pool
        if host is None or copier is None or pool is None:
            return {}
        c = copier.stats
        return {
            "num_host_blocks": host.num_slots,
            "num_host_free_blocks": host.num_free,
            "num_host_cached_blocks": len(host.cached),
            "num_copying_blocks": pool.num_copying,
            "num_host_blocks_read": host.num_read,
            "host_hit_tokens": self.manager.host_hit_tokens if self.manager else 0,
            "host_evictions": host.num_evictions,
            "bytes_to_host": c.bytes_to_host,
            "bytes_from_host": c.bytes_from_host,
            "copy_to_host_seconds": c.seconds_to_host,
            "copy_from_host_seconds": c.seconds_from_host,
            "copy_batches_to_host": c.batches_to_host,
            "copy_batches_from_host": c.batches_from_host,
        }

    def _hashes(self, token_ids: Sequence[int], cache_salt: bytes, extra_keys: Sequence[bytes]) -> list[bytes]:
        extra = encode_extra_keys(cache_salt, extra_keys)
        return sequence_block_hashes(token_ids, self.config.block_size, extra)

    # ------------------------------------------------------------- events

    def subscribe(self) -> tuple[queue.SimpleQueue, EventsSnapshot]:
        """What is cached now, and a queue that receives every later batch of
        block events as ``(incarnation, sequence, events)``: taken under one
        lock, so nothing falls between the two."""
        subscriber: queue.SimpleQueue = queue.SimpleQueue()
        with self.lock:
            self._subscribers.append(subscriber)
            return subscriber, EventsSnapshot(
                self.cache_id,
                self._sequence,
                list(self.pool.cached) if self.pool else [],
                list(self.host.cached) if self.host else [],
            )

    def unsubscribe(self, subscriber: queue.SimpleQueue) -> None:
        with self.lock:
            if subscriber in self._subscribers:
                self._subscribers.remove(subscriber)

    def _publish(self) -> None:
        """Hands this call's events to every subscriber (under the lock)."""
        events: list[BlockEvent] = self.pool.take_events() if self.pool else []
        if events:
            self._sequence += 1
            for subscriber in self._subscribers:
                subscriber.put((self.cache_id, self._sequence, events))

    def close(self) -> None:
        if self.copier is not None:
            self.copier.drain(timeout_s=10)
            self.copier.close()
        with self.lock:
            for subscriber in self._subscribers:
                subscriber.put(None)
            self._subscribers.clear()
            if self.memory is not None:
                self.memory.close()
