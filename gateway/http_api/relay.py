"""Blocking service calls run on threads, their results handed to the event loop.

``GatewayService`` is synchronous (its streams block on the engine's gRPC
stream), so each HTTP request runs its call on a thread of its own pool, as
the gRPC server runs each call on a worker thread. A stream's messages reach
the event loop through a queue; whichever way the request ends (done, failed,
its client gone), ``LocalCall.end`` runs the call's callbacks, which cancels
an engine request still running and so frees its blocks at once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from gateway.http_api.calls import LocalCall

T = TypeVar("T")

_END = object()


class Relay:
    """Args:
    max_threads: calls running at once (more wait for a thread).
    """

    def __init__(self, max_threads: int) -> None:
        self.executor = ThreadPoolExecutor(max_workers=max_threads, thread_name_prefix="gateway-http")

    async def call(self, call: LocalCall, fn: Callable[[], T]) -> T:
        """``fn()`` on a thread; the call ends when it returns, or when the awaiting task is cancelled."""
        try:
            return await asyncio.get_running_loop().run_in_executor(self.executor, fn)
        finally:
            call.end()

    async def stream(self, call: LocalCall, open_stream: Callable[[], Iterator[T]]) -> AsyncIterator[T]:
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
