"""The daemon's cache: memory, block pool, manager, pins and host tier, made together.

A ``KVCache`` exists whole or not at all: the daemon creates it from the first
layout it learns (its config, or the first engine's attach), so nothing in it
is ever half-made.
"""

from __future__ import annotations

import gc
import hashlib
import logging
import math
import threading
import uuid
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from kvd.block import Block
from kvd.block_pool import DISK, BlockEvent, BlockPool, BlockRemoved
from kvd.cache_manager import KVCacheManager, Offload, SwapIn
from kvd.common.hashing import BlockHasher, encode_extra_keys, pack_tokens
from kvd.common.identity import ModelIdentity
from kvd.common.layout import CacheLayout
from kvd.common.memory import KVMemory
from kvd.config import DaemonConfig
from kvd.disk_format import fingerprint
from kvd.disk_store import DiskStore
from kvd.disk_tier import DiskTier
from kvd.errors import PreconditionError
from kvd.host_tier import HostTier
from kvd.offload import TierCopier
from kvd.pins import PinRegistry

log = logging.getLogger("kvd.cache")


class CachedPrefix(NamedTuple):
    """How much of a prompt's leading blocks each tier holds (the Lookup RPC's answer)."""

    device_hashes: list[bytes]  # the leading blocks' hashes cached on the device
    num_host_blocks: int  # blocks after those that the host tier holds
    num_disk_blocks: int  # blocks after those that the disk tier holds


class InspectedBlock(NamedTuple):
    """A block as the daemon sees it (the InspectBlock RPC's answer)."""

    block: Block  # its metadata (ref_cnt, hash)
    data_sha256: bytes  # the sha256 of its bytes, read by the daemon


class KVCache:
    """Everything that holds or indexes KV blocks. Not thread-safe by itself:
    every method runs under the daemon's lock (``lock``), which the tier
    copier's worker takes too before it calls back.

    Args:
        config: the daemon's settings (block size, sizes, device, host tier).
        model_layout: the model's layout; its ``block_size`` is replaced by the config's.
        lock: the daemon's lock.
        publish: receives the pool's events after a copy finished.
    """

    def __init__(
        self,
        config: DaemonConfig,
        model_layout: CacheLayout,
        lock: threading.Lock,
        publish: Callable[[Sequence[BlockEvent]], None],
    ) -> None:
        self.block_size = config.block_size
        self._config = config
        self._lock = lock
        self._publish = publish
        layout = CacheLayout(
            model_layout.num_layers, model_layout.num_kv_heads, model_layout.head_dim, config.block_size,
            model_layout.dtype,
        )  # fmt: skip
        num_blocks = config.num_blocks or layout.num_blocks_for(config.memory_budget_bytes)
        self.memory = KVMemory(layout, num_blocks, config.device, config.shm_dir)
        self.cache_id = uuid.uuid4().hex  # a new cache, a new id: engines tell restarts apart
        self.model: ModelIdentity | None = None  # named by the first engine that names one (kvd.common.identity)
        self.pool = BlockPool(num_blocks, enable_caching=config.enable_caching, record_events=True)
        num_host_blocks = config.host_num_blocks or (config.host_memory_budget_bytes // layout.block_bytes)
        self.host: HostTier | None = None
        self.copier: TierCopier | None = None
        self.disk: DiskTier | None = None  # opened once the model is known (its fingerprint names the folder)
        if num_host_blocks and config.enable_caching:
            self.host = HostTier(num_host_blocks, record=self.pool.record)
            self.copier = TierCopier(self.memory.tensor, num_host_blocks, lock, self._offloaded, self._swapped_in)
        self.manager = KVCacheManager(self.pool, config.block_size, self.host)
        self.pins = PinRegistry(self.pool, int(num_blocks * config.max_pinned_fraction))
        # NOTE: the pool's blocks live as long as the daemon; frozen, the cyclic
        # garbage collector stops scanning them (~10 ms per full pass at 128k
        # blocks, which would land inside some unlucky Step).
        gc.freeze()
        log.info(
            "cache created",
            extra={"layout": layout.describe(), "num_blocks": num_blocks, "bytes": self.memory.nbytes,
                   "device": config.device, "host_blocks": num_host_blocks if self.host else 0},
        )  # fmt: skip

    @property
    def layout(self) -> CacheLayout:
        return self.memory.layout

    def admit_model(self, model: ModelIdentity) -> None:
        """Takes an attaching engine's model: the cache's from now on if it has
        none yet, else it must be the same one.

        Raises:
            PreconditionError: another model, naming what differs.
        """
        if self.model is None:
            self.model = model
            log.info("cache model", extra={"model": model.describe(), "fingerprint": model.fingerprint()})
            self._open_disk(model)
            return
        differences = self.model.differences(model)
        if differences:
            raise PreconditionError(
                f"the engine's model {model.describe()} is not this cache's {self.model.describe()} "
                f"({'; '.join(differences)}): its blocks would hold another model's numbers under the same "
                "hashes; serve it from a daemon of its own"
            )

    def _open_disk(self, model: ModelIdentity) -> None:
        """Opens the disk tier under this model's and layout's fingerprint (its
        index rebuilt from the folder). A folder that cannot be used leaves
        the daemon serving without it."""
        config = self._config
        if not config.disk_path or self.host is None or self.copier is None:
            return
        try:
            store = DiskStore(
                config.disk_path, fingerprint(model, self.layout), self.layout.block_bytes,
                config.disk_budget_bytes, remove_others=config.disk_remove_others,
            )  # fmt: skip
        except OSError as exc:
            log.error("disk tier unusable; serving without it", extra={"path": config.disk_path, "error": str(exc)})
            return
        self.disk = DiskTier(store, self.host, self.copier.host, self._lock, self._disk_events)
        self.manager.disk = self.disk

    # Called by the copier's and the disk tier's threads, under the lock.
    def _offloaded(self, offloads: Sequence[Offload]) -> None:
        assert self.host is not None
        for block, slot in offloads:
            self.pool.copy_finished(block)
            self.host.written(slot)
        if self.disk is not None:
            self.disk.offer([slot for _, slot in offloads])
        self._publish(self.pool.take_events())

    def _disk_events(self, events: Sequence[BlockEvent]) -> None:
        for event in events:
            self.pool.record(event)
        self._publish(self.pool.take_events())

    def _swapped_in(self, swap_ins: Sequence[SwapIn]) -> None:
        assert self.host is not None
        self.host.end_read([slot for slot, _ in swap_ins])

    def wait_for_copies(self, timeout_s: float = 60.0) -> bool:
        """Waits until every tier copy submitted so far finished. Call without the lock."""
        # NOTE: host copies first: a finished one may queue disk writes.
        copies = self.copier is None or self.copier.wait_for_copies(timeout_s)
        return copies and (self.disk is None or self.disk.wait_for_io(timeout_s))

    def block_hashes(self, token_ids: Sequence[int], cache_salt: bytes, extra_keys: Sequence[bytes]) -> list[bytes]:
        hasher = BlockHasher(encode_extra_keys(cache_salt, extra_keys), self.block_size)
        return hasher.advance(pack_tokens(token_ids))  # every id checked, the partial tail's too

    def cached_prefix(self, hashes: Sequence[bytes]) -> CachedPrefix:
        """What each tier holds of the blocks ``hashes`` name, from the first on."""
        on_device = len(self.pool.match_prefix(hashes))
        in_memory = len(self.manager.match_tiers(hashes))
        on_disk = 0
        if self.disk is not None:
            for block_hash in hashes[in_memory:]:
                if not self.disk.holds(block_hash):
                    break
                on_disk += 1
        return CachedPrefix(list(hashes[:on_device]), in_memory - on_device, on_disk)

    def reset(self) -> int:
        """Empties every tier; returns the device blocks whose content was dropped.

        Raises:
            PreconditionError: blocks are in use, or tier copies are in flight.
        """
        try:
            if self.host is not None and self.host.num_in_copy:
                raise ValueError("tier copies are in flight")
            self._drop_marks_if_alone()
            cleared = self.pool.reset()
        except ValueError as exc:
            raise PreconditionError(f"cannot reset the cache: {exc}") from None
        if self.host is not None:
            self.host.clear()
        if self.disk is not None:
            removed = self.disk.clear()
            if removed:
                self.pool.record(BlockRemoved(tuple(removed), DISK))
        return cleared

    def _drop_marks_if_alone(self) -> None:
        """Unpins every expiring pin (cache marks) when they alone keep the
        pool from resetting: a mark keeps a prefix warm, it does not outlast
        an emptied cache. Otherwise nothing changes (the reset is refused)."""
        in_use = self.pool.num_blocks - self.pool.num_free
        if in_use and in_use == self.pins.expiring_only_blocks():
            self.pins.expire(math.inf)

    def inspect_block(self, block_id: int) -> InspectedBlock:
        """A block's metadata and the sha256 of its bytes, read here."""
        if not 0 <= block_id < self.pool.num_blocks:
            raise ValueError(f"block_id must be in [0, {self.pool.num_blocks}), got {block_id}")
        data = self.memory.tensor[block_id].contiguous().cpu()
        digest = hashlib.sha256(data.view(torch.uint8).numpy().tobytes()).digest()
        return InspectedBlock(self.pool.blocks[block_id], digest)

    def stop_copies(self) -> None:
        """Finishes the tier copies in flight and stops the copier. Call without the lock."""
        if self.copier is not None:
            self.copier.wait_for_copies(timeout_s=10)
            self.copier.close()
        if self.disk is not None:
            self.disk.wait_for_io(timeout_s=10)
            self.disk.close()

    def close(self) -> None:
        """Frees the memory (after ``stop_copies``)."""
        self.memory.close()
