"""Block events fanned out to subscribers (the ``Events`` stream).

Each subscriber is a queue that receives every later batch of events in the
order they were published; ``None`` tells it the stream is over.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence

from kvd.block_pool import BlockEvent

EventBatch = list[BlockEvent]


class EventHub:
    """The subscribers of one daemon. Thread-safe."""

    def __init__(self) -> None:
        # NOTE: its own lock, so an RPC thread subscribing never waits behind a Step.
        self._lock = threading.Lock()
        self._subscribers: list[queue.SimpleQueue[EventBatch | None]] = []

    def subscribe(self) -> queue.SimpleQueue[EventBatch | None]:
        """A queue that receives every later batch of events."""
        subscriber: queue.SimpleQueue[EventBatch | None] = queue.SimpleQueue()
        with self._lock:
            self._subscribers.append(subscriber)
        return subscriber

    def unsubscribe(self, subscriber: queue.SimpleQueue) -> None:
        with self._lock:
            if subscriber in self._subscribers:
                self._subscribers.remove(subscriber)

    def publish(self, events: Sequence[BlockEvent]) -> None:
        """Hands one batch to every subscriber; an empty batch is not sent."""
        if not events:
            return
        batch = list(events)
        with self._lock:
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
