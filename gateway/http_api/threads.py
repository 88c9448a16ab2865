"""Blocking request-path calls run on threads, their results handed to the event loop.

The request path is synchronous (a generation blocks on the engine's gRPC
stream), so each HTTP request runs its call on a thread of ``WorkerThreads``,
as the gRPC server runs each call on a worker thread. A stream's messages
reach the event loop through a queue. Each request is an ``HttpCall`` (the
request path's ``CallLifetime``); whichever way it ends (done, failed, its
client gone), ``HttpCall.end`` runs what the request path registered, which
cancels an engine request still running and so frees its blocks at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

log = logging.getLogger("gateway.http")

T = TypeVar("T")

_END = object()


class HttpCall:
    """One HTTP request's lifetime, as the request path's ``CallLifetime``:
    no deadline (the client closes the connection instead), and callbacks
    run once when ``end`` is called."""

    def __init__(self) -> None:
        self._callbacks: list[Callable[[], None]] = []
        self._active = True
        self._lock = threading.Lock()

    def time_remaining(self) -> float | None:
        return None

    def is_active(self) -> bool:
        return self._active

    def add_callback(self, callback: Callable[[], None]) -> bool:
        with self._lock:
            if self._active:
                self._callbacks.append(callback)
            return self._active

    def end(self) -> None:
        """The call is over (its reply sent, or its client gone): runs the
        callbacks once, which cancels an engine request still running."""
        with self._lock:
            self._active = False
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            try:
                callback()
            except Exception:  # one failing callback must not keep the others from running
                log.exception("call callback failed")


class WorkerThreads:
    """Args:
    max_threads: calls running at once (more wait for a thread).
    """

    def __init__(self, max_threads: int) -> None:
        self.executor = ThreadPoolExecutor(max_workers=max_threads, thread_name_prefix="gateway-http")

    async def call(self, call: HttpCall, fn: Callable[[], T]) -> T:
        """``fn()`` on a thread; the call ends when it returns, or when the awaiting task is cancelled."""
        try:
            return await asyncio.get_running_loop().run_in_executor(self.executor, fn)
        finally:
            call.end()

    async def stream(self, call: HttpCall, open_stream: Callable[[], Iterator[T]]) -> AsyncIterator[T]:
        """The items of ``open_stream()``, iterated on a thread; its exception re-raised here.

        Closing this iterator early (the client left) ends the call, which
        makes the thread's blocking read end too.
        """
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        put = queue.put_nowait

        def send(item, error=None) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is closed (the server stopped): nobody to tell
                loop.call_soon_threadsafe(put, (item, error))

        def pump() -> None:
            stream = None
            try:
                stream = open_stream()
                for item in stream:
                    send(item)
                    if not call.is_active():
                        break
                send(_END)
            except BaseException as exc:  # handed to the loop, raised there
                send(_END, exc)
            finally:
                if stream is not None and hasattr(stream, "close"):
                    stream.close()  # a generator left early runs its cleanup now

        worker = loop.run_in_executor(self.executor, pump)
        try:
            while True:
                item, error = await queue.get()
                if item is _END:
                    if error is not None:
                        raise error
                    return
                yield item
        finally:
            call.end()
            if not worker.done():
                worker.add_done_callback(lambda f: f.exception())  # nothing to await it: mark it retrieved

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
