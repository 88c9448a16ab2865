"""Copies of block bytes between the device cache and the host tier.

Outgoing copies (device to host, after the step that filled a block) never
block a step: without a GPU a worker thread does them; on CUDA they run on a
dedicated stream into pinned memory, and the worker only waits for their
event. Either way the worker then finishes them under the daemon's lock (the
device blocks stop COPYING, the host slots start serving hits).

Incoming copies (host to device, a host-tier hit) must be done before the
engine reads the blocks: without a GPU they run in the step itself; on CUDA
they are queued on the same stream and the step's reply carries an
interprocess event for the engine's stream to wait on.

The other direction of that wait: on CUDA a copy must not start while an
engine's forward may still write or read its blocks. Each submit takes the
engines' forward events to wait for first (``after``: interprocess event
handles, opened once each and kept: an engine records into a small ring of
events, so the same few handles come back every step).
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvd.cache_manager import Offload, SwapIn

log = logging.getLogger("kvd.offload")

#: Events of incoming copies kept alive after they finished, so that an engine
#: that has not opened a reply's event handle yet never opens a destroyed one.
_RETIRED_EVENTS_KEPT = 256

#: Engines' forward events kept open (a ring of a few per engine; more than
#: any daemon has engines).
_ENGINE_EVENTS_KEPT = 64


@dataclass
class CopyStats:
    bytes_to_host: int = 0
    bytes_from_host: int = 0
    seconds_to_host: float = 0.0  # submit to finish, summed over batches
    seconds_from_host: float = 0.0
    batches_to_host: int = 0
    batches_from_host: int = 0


@dataclass(frozen=True, slots=True)
class _CopiesOut:
    """Submitted device-to-host copies, for the worker to finish."""

    offloads: list[Offload]
    event: torch.cuda.Event | None  # recorded after them on the copy stream; None: the worker copies
    started: float  # perf_counter at submit
    direction: ClassVar[str] = "out"

    @property
    def num_blocks(self) -> int:
        return len(self.offloads)


@dataclass(frozen=True, slots=True)
class _CopiesIn:
    """Submitted host-to-device copies (CUDA), for the worker to finish."""

    swap_ins: list[SwapIn]
    event: torch.cuda.Event  # recorded after them on the copy stream
    started: float  # perf_counter at submit
    job_id: int  # its entry in ``_pending_in``
    direction: ClassVar[str] = "in"

    @property
    def num_blocks(self) -> int:
        return len(self.swap_ins)


def _host_tensor(shape: tuple[int, ...], dtype: torch.dtype, pinned: bool) -> torch.Tensor:
    """The host tier's memory, resident from the start.

    NOTE: committed now rather than as the tier fills, so the daemon's memory
    is what it will be under load from its first minute (a soak showed its
    RSS climb 85% as the tier filled, indistinguishable from a leak), and a
    tier the machine cannot hold fails at start, not hours into serving.
    Pinned memory (CUDA: asynchronous copies need page-locked pages) is
    resident once allocated; plain memory is zeroed to touch every page
    (about 0.4 s per GiB on the 2-core test box).
    """
    if pinned:
        return torch.empty(shape, dtype=dtype, pin_memory=True)
    return torch.zeros(shape, dtype=dtype)


class TierCopier:
    """Moves blocks between ``cache`` (device tier) and its own host tensor.

    Args:
        cache: the daemon's cache tensor, ``[num_blocks, *block_shape]``.
        num_host_blocks: slots of the host tensor.
        lock: the daemon's lock, held while finishing copies.
        finish_out: called under ``lock`` with finished outgoing copies.
        finish_in: called under ``lock`` with finished incoming copies.
    """

    def __init__(
        self,
        cache: torch.Tensor,
        num_host_blocks: int,
        lock: threading.Lock,
        finish_out: Callable[[Sequence[Offload]], None],
        finish_in: Callable[[Sequence[SwapIn]], None],
    ) -> None:
        self.cache = cache
        self.on_cuda = cache.is_cuda
        self.host = _host_tensor((num_host_blocks, *cache.shape[1:]), cache.dtype, self.on_cuda)
        self.block_bytes = cache[0].numel() * cache.element_size()
        self.stats = CopyStats()
        self._lock = lock
        self._finish_out = finish_out
        self._finish_in = finish_in
        self._jobs: queue.SimpleQueue[_CopiesOut | _CopiesIn | None] = queue.SimpleQueue()  # None: stop
        self._outstanding = 0
        self._idle = threading.Condition()
        self._stream = torch.cuda.Stream(device=cache.device) if self.on_cuda else None
        self._pending_in: dict[int, bytes] = {}  # job id -> event handle, CUDA only
        self._retired = collections.deque(maxlen=_RETIRED_EVENTS_KEPT)
        self._engine_events: collections.OrderedDict[bytes, torch.cuda.Event] = collections.OrderedDict()
        self._next_job = 0
        self._worker = threading.Thread(target=self._run, name="kvd-offload", daemon=True)
        self._worker.start()

    # ------------------------------------------------------------ submit
    # Both are called under the daemon's lock.

    def copy_out(self, offloads: Sequence[Offload], after: Sequence[bytes] = ()) -> None:
        """Starts copying device blocks to their host slots; returns at once.
        On CUDA the copies start once the events ``after`` have completed."""
        if not offloads:
            return
        started = time.perf_counter()
        event = None
        if self._stream is not None:
            self._wait_for_engines(after)
            with torch.cuda.stream(self._stream):
                for block, slot in offloads:
                    self.host[slot.slot_id].copy_(self.cache[block.block_id], non_blocking=True)
                event = torch.cuda.Event()
                event.record(self._stream)
        self._submit(_CopiesOut(list(offloads), event, started))

    def copy_in(self, swap_ins: Sequence[SwapIn], after: Sequence[bytes] = ()) -> None:
        """Copies host slots into device blocks: done on return without a GPU;
        on CUDA queued behind the events ``after``, with an event in
        :meth:`pending_events` until done."""
        if not swap_ins:
            return
        started = time.perf_counter()
        if self._stream is None:
            for slot, block in swap_ins:
                self.cache[block.block_id].copy_(self.host[slot.slot_id])
            self._count_in(len(swap_ins), time.perf_counter() - started)
            self._finish_in(swap_ins)
            return
        # The stream first waits for the daemon's own work on the cache (none
        # today but the initial zeroing), then copies behind earlier offloads.
        self._stream.wait_stream(torch.cuda.current_stream(self.cache.device))
        self._wait_for_engines(after)
        with torch.cuda.stream(self._stream):
            for slot, block in swap_ins:
                self.cache[block.block_id].copy_(self.host[slot.slot_id], non_blocking=True)
            event = torch.cuda.Event(interprocess=True)
            event.record(self._stream)
        job_id = self._next_job
        self._next_job += 1
        self._pending_in[job_id] = event.ipc_handle()
        self._submit(_CopiesIn(list(swap_ins), event, started, job_id))

    def _wait_for_engines(self, handles: Sequence[bytes]) -> None:
        """Makes the copy stream wait for engines' interprocess events (CUDA)."""
        for handle in handles:
            event = self._engine_events.get(handle)
            if event is None:
                event = torch.cuda.Event.from_ipc_handle(self.cache.device, handle)
                self._engine_events[handle] = event
                if len(self._engine_events) > _ENGINE_EVENTS_KEPT:
                    self._engine_events.popitem(last=False)
            else:
                self._engine_events.move_to_end(handle)
            self._stream.wait_event(event)

    def pending_events(self) -> list[bytes]:
        """Event handles of incoming copies not known to be finished (CUDA):
        any engine reading the cache now waits for them."""
        return list(self._pending_in.values())

    # ------------------------------------------------------------ worker

    def _submit(self, job: _CopiesOut | _CopiesIn) -> None:
        with self._idle:
            self._outstanding += 1
        self._jobs.put(job)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                match job:
                    case _CopiesOut():
                        self._finish_copies_out(job)
                    case _CopiesIn():
                        self._finish_copies_in(job)
            except Exception:  # a failed copy must not kill the worker; the blocks stay held
                log.exception("tier copy failed", extra={"direction": job.direction, "blocks": job.num_blocks})
            finally:
                with self._idle:
                    self._outstanding -= 1
                    self._idle.notify_all()

    def _finish_copies_out(self, job: _CopiesOut) -> None:
        if job.event is None:
            for block, slot in job.offloads:
                self.host[slot.slot_id].copy_(self.cache[block.block_id])
        else:
            job.event.synchronize()
        with self._lock:
            stats = self.stats
            stats.bytes_to_host += len(job.offloads) * self.block_bytes
            stats.seconds_to_host += time.perf_counter() - job.started
            stats.batches_to_host += 1
            self._finish_out(job.offloads)

    def _finish_copies_in(self, job: _CopiesIn) -> None:
        job.event.synchronize()
        with self._lock:
            self._count_in(len(job.swap_ins), time.perf_counter() - job.started)
            del self._pending_in[job.job_id]
            self._retired.append(job.event)
            self._finish_in(job.swap_ins)

    def _count_in(self, num_blocks: int, seconds: float) -> None:
        stats = self.stats
        stats.bytes_from_host += num_blocks * self.block_bytes
        stats.seconds_from_host += seconds
        stats.batches_from_host += 1

    # ------------------------------------------------------------ control

    def wait_for_copies(self, timeout_s: float = 60.0) -> bool:
        """Waits (without the daemon's lock) until every submitted copy finished."""
        with self._idle:
            return self._idle.wait_for(lambda: self._outstanding == 0, timeout=timeout_s)

    def close(self) -> None:
        self._jobs.put(None)
        self._worker.join(timeout=10)
