"""Block events fanned out to subscribers (the ``Events`` stream).

A subscriber first gets a snapshot of what is cached, then every later batch
of events in the order they were published, each an ``EventBatch`` numbered
consecutively per incarnation (the cache's id); ``None`` tells it the stream
is over. A subscriber that sees a gap or another incarnation has missed
events and subscribes again.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvd.block_pool import BlockEvent


@dataclass(frozen=True)
class EventBatch:
    incarnation: str
    sequence: int
    events: list[BlockEvent]


@dataclass(frozen=True)
class EventsSnapshot:
    """The cached blocks' hashes per tier, as of the batch numbered ``sequence``."""

    incarnation: str
    sequence: int
    device: list[bytes]
    host: list[bytes]
    disk: list[bytes]


#: What is cached now, per tier: (device hashes, host hashes, disk hashes).
CachedHashes = Callable[[], tuple[list[bytes], list[bytes], list[bytes]]]


class EventHub:
    """The subscribers of one daemon and the numbering of its batches. Thread-safe.

    Args:
        cached: reads what is cached now, for a new subscriber's snapshot.
            The caller of ``subscribe`` holds whatever lock ``publish``'s
            callers hold, so no batch falls between the snapshot and the stream.
    """

    def __init__(self, cached: CachedHashes) -> None:
        # NOTE: its own lock, so an RPC thread subscribing never waits behind a
        # Step for the subscriber list (only for the snapshot, under the daemon's).
        self._lock = threading.Lock()
        self._cached = cached
        self._subscribers: list[queue.SimpleQueue[EventBatch | None]] = []
        self._incarnation = ""
        self._sequence = 0  # of the last batch published

    def new_incarnation(self, incarnation: str) -> None:
        """A new cache: its batches are numbered from 1 under its id."""
        with self._lock:
            self._incarnation = incarnation
            self._sequence = 0

    def subscribe(self) -> tuple[queue.SimpleQueue[EventBatch | None], EventsSnapshot]:
        """What is cached now, and a queue that receives every later batch."""
        subscriber: queue.SimpleQueue[EventBatch | None] = queue.SimpleQueue()
        device, host, disk = self._cached()
        with self._lock:
            self._subscribers.append(subscriber)
            return subscriber, EventsSnapshot(self._incarnation, self._sequence, device, host, disk)

    def unsubscribe(self, subscriber: queue.SimpleQueue) -> None:
        with self._lock:
            if subscriber in self._subscribers:
                self._subscribers.remove(subscriber)

    def publish(self, events: Sequence[BlockEvent]) -> None:
        """Hands one batch to every subscriber; an empty batch is not sent (nor numbered)."""
        if not events:
            return
        with self._lock:
            self._sequence += 1
            batch = EventBatch(self._incarnation, self._sequence, list(events))
            for subscriber in self._subscribers:
                subscriber.put(batch)

    def close(self) -> None:
        """Ends every subscriber's stream."""
        with self._lock:
            for subscriber in self._subscribers:
                subscriber.put(None)
            self._subscribers.clear()

    @property
    def num_subscribers(self) -> int:
        with self._lock:
            return len(self._subscribers)
