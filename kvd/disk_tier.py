"""The disk tier: blocks written from the host tier to disk, and read back into it.

Below the host tier, above recomputing. Every block that enters the host tier
is written through to disk by a writer thread, off the Step's path (a block
reaches disk soon after it was computed, so a SIGKILL loses at most the
writer's queue). While the writer reads a host slot, the slot has a reader,
so it is not evicted or reused: the host tier's rule that no block is reused
while a copy into or out of it is in flight.

A prompt whose next blocks miss the device and host tiers but are on disk
waits (admission answers DEFERRED) while a reader thread loads them into host
slots reserved for them (WRITING: not readable, not reusable); once loaded
they are ordinary host blocks, and the next Step's admission copies them to
the device as host hits (counted as the disk's). A block whose file is torn or
corrupt is dropped (counted) and its slot freed: the prompt recomputes it.

A write that fails (disk full, I/O error) disables writes with one warning;
reads and the other tiers go on serving.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from kvd.block_pool import DISK, BlockEvent, BlockRemoved, BlockStored
from kvd.disk_store import DiskStore
from kvd.host_tier import HostSlot, HostTier

log = logging.getLogger("kvd.disk")


@dataclass
class DiskCounters:
    """What the tier did since start (Stats, metrics)."""

    writes: int = 0
    writes_skipped: int = 0  # the writer's queue was full, or writes are disabled
    write_errors: int = 0
    loads: int = 0  # blocks read back into the host tier
    load_failures: int = 0  # gone or corrupt: recomputed
    seconds_writing: float = 0.0


class _BlockJob(NamedTuple):
    """One block for the writer (slot to disk) or the reader (disk to slot)."""

    slot: HostSlot
    block_hash: bytes


#: A batch for one thread, as its queue holds it (None: stop).
_Batch = list[_BlockJob]


class DiskTier:
    """Moves blocks between the host tier's slots and a ``DiskStore``.

    Args:
        store: the block files.
        host: the host tier's bookkeeping.
        host_tensor: the host tier's memory (``[slots, *block_shape]``).
        lock: the daemon's lock, held while finishing a batch.
        on_events: called under ``lock`` with a finished batch's block events.
    """

    def __init__(
        self,
        store: DiskStore,
        host: HostTier,
        host_tensor: torch.Tensor,
        lock: threading.Lock,
        on_events: Callable[[list[BlockEvent]], None],
    ) -> None:
        self.store = store
        self.host = host
        self._bytes = host_tensor.view(torch.uint8).reshape(host_tensor.shape[0], -1).numpy()
        self._lock = lock
        self._on_events = on_events
        self.counters = DiskCounters()
        self.writes_enabled = True
        # NOTE: the writer's backlog holds its host slots out of eviction;
        # half the host tier at most, so offloads always find room.
        self.max_queued_writes = max(1, host.num_slots // 2)
        self._queued: set[bytes] = set()  # hashes waiting for the writer or being written
        self.loading: dict[bytes, HostSlot] = {}  # hashes being read into host slots
        self._writes: queue.SimpleQueue[_Batch | None] = queue.SimpleQueue()
        self._reads: queue.SimpleQueue[_Batch | None] = queue.SimpleQueue()
        self._outstanding = 0
        self._idle = threading.Condition()
        self._threads = [
            threading.Thread(target=self._write_loop, name="kvd-disk-writer", daemon=True),
            threading.Thread(target=self._read_loop, name="kvd-disk-reader", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    # ------------------------------------------------------------ under the daemon's lock

    def holds(self, block_hash: bytes) -> bool:
        return self.store.holds(block_hash)

    def offer(self, slots: Sequence[HostSlot]) -> None:
        """Host slots that just became READY: write their blocks through to disk."""
        jobs: _Batch = []
        for slot in slots:
            block_hash = slot.block_hash
            if slot.from_disk or block_hash is None or block_hash in self._queued or self.store.holds(block_hash):
                continue
            if not self.writes_enabled or len(self._queued) >= self.max_queued_writes:
                self.counters.writes_skipped += 1
                continue
            self._queued.add(block_hash)
            jobs.append(_BlockJob(slot, block_hash))
        if jobs:
            self.host.begin_read([slot for slot, _ in jobs])
            self._submit(self._writes, jobs)

    def load(self, hashes: Sequence[bytes], limit: int) -> int:
        """Starts reading the leading ``hashes`` that are on disk (and in no
        tier above) into host slots, at most ``limit``; returns how many started.

        Stops at the first hash that is neither on disk nor in a tier above,
        or when the host tier has no slot to give.
        """
        jobs: _Batch = []
        for block_hash in hashes:
            if len(jobs) >= limit:
                break
            if self.host.holds(block_hash):
                continue
            if not self.store.holds(block_hash):
                break
            slot = self.host.reserve(block_hash)
            if slot is None:
                break
            slot.from_disk = True
            self.loading[block_hash] = slot
            jobs.append(_BlockJob(slot, block_hash))
        if jobs:
            self._submit(self._reads, jobs)
        return len(jobs)

    def clear(self) -> list[bytes]:
        """Removes every block file of this cache (Reset); returns their hashes."""
        return self.store.clear()

    # ------------------------------------------------------------ threads

    def _submit(self, jobs_queue: queue.SimpleQueue[_Batch | None], jobs: _Batch) -> None:
        with self._idle:
            self._outstanding += 1
        jobs_queue.put(jobs)

    def _loop(self, jobs_queue: queue.SimpleQueue[_Batch | None], work: Callable[[_Batch], None]) -> None:
        while True:
            jobs = jobs_queue.get()
            if jobs is None:
                return
            try:
                work(jobs)
            except Exception:  # the thread must live on; the slots it held stay held
                log.exception("disk tier batch failed", extra={"blocks": len(jobs)})
            finally:
                with self._idle:
                    self._outstanding -= 1
                    self._idle.notify_all()

    def _write_loop(self) -> None:
        self._loop(self._writes, self._write)

    def _read_loop(self) -> None:
        self._loop(self._reads, self._read)

    def _write(self, jobs: _Batch) -> None:
        started = time.perf_counter()
        written, evicted = [], []
        error = None
        for slot, block_hash in jobs:
            if error is not None:
                break
            try:
                gone = self.store.write(block_hash, memoryview(self._bytes[slot.slot_id]))
            except OSError as exc:
                error = exc
                continue
            if gone is not None:
                evicted += gone
                written.append(block_hash)
        if written and error is None:
            try:
                self.store.sync_folders(written)
            except OSError as exc:
                error = exc
        with self._lock:
            self.host.end_read([slot for slot, _ in jobs])
            self._queued.difference_update(block_hash for _, block_hash in jobs)
            self.counters.writes += len(written)
            self.counters.seconds_writing += time.perf_counter() - started
            if error is not None:
                self._disable_writes(error)
            events: list[BlockEvent] = []
            if evicted:
                events.append(BlockRemoved(tuple(evicted), DISK))
            if written:
                events.append(BlockStored(tuple(written), DISK))
            if events:
                self._on_events(events)

    def _disable_writes(self, error: OSError) -> None:
        self.counters.write_errors += 1
        if self.writes_enabled:
            self.writes_enabled = False
            log.warning(
                "disk tier writes disabled: serving goes on from the other tiers and the blocks already on disk",
                extra={"error": str(error), "folder": str(self.store.folder)},
            )

    def _read(self, jobs: _Batch) -> None:
        results = self.store.read_batch([(h, memoryview(self._bytes[slot.slot_id])) for slot, h in jobs])
        with self._lock:
            failed = []
            for (slot, block_hash), ok in zip(jobs, results, strict=True):
                del self.loading[block_hash]
                if ok:
                    self.host.written(slot)
                else:
                    self.host.abandon(slot)
                    failed.append(block_hash)
            self.counters.loads += len(jobs) - len(failed)
            self.counters.load_failures += len(failed)
            if failed:
                self._on_events([BlockRemoved(tuple(failed), DISK)])

    # ------------------------------------------------------------ control

    def wait_for_io(self, timeout_s: float = 60.0) -> bool:
        """Waits (without the daemon's lock) until every queued write and read finished."""
        with self._idle:
            return self._idle.wait_for(lambda: self._outstanding == 0, timeout=timeout_s)

    def close(self) -> None:
        self._writes.put(None)
        self._reads.put(None)
        for thread in self._threads:
            thread.join(timeout=10)
        self.store.close()
