"""The prompts of one ``/v1/completions`` request, run at once through the request path.

Each prompt is a generation of its own (its own engine request, routed by
its own blocks); their messages come back interleaved, each tagged with its
prompt's index. At most ``width`` run at once: the tenant's free request
slots (``--max-concurrent-requests``), else ``MAX_WIDTH``, so a batch is not
refused for exceeding its tenant's limit by its own size. All of them share
the HTTP request's call: when it ends (its client left, or one prompt
failed), every engine request of the batch is cancelled.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

from gateway.http_api.threads import HttpCall
from kvd_api.gateway.v1 import gateway_pb2 as pb

#: Prompts of one request run at once when the tenant has no limit.
MAX_WIDTH = 16

_DONE = object()


class Indexed(NamedTuple):
    """One message of prompt ``index``'s generation."""

    index: int
    message: pb.GenerateResponse


def forked(requests: Sequence[pb.GenerateRequest], n: int) -> tuple[list[pb.GenerateRequest], dict[int, int]]:
    """``n`` choices of each request, prompt by prompt (choice ``p * n + i``),
    and the leader each later fork waits for.

    Fork 0 of a prompt leads; the others start once it has streamed its first
    message: by then the prompt is computed, and the daemon learns its blocks
    (the leader's commit) in the same Step that brings the forks, before it
    admits them. So the forks share the prompt's full blocks and recompute
    only its last, partial one. A seeded request's fork ``i`` draws with seed
    + i: the forks differ, and the whole reply is reproducible.
    """
    out: list[pb.GenerateRequest] = []
    leaders: dict[int, int] = {}
    for request in requests:
        leader = len(out)
        for i in range(n):
            fork = pb.GenerateRequest()
            fork.CopyFrom(request)
            if i:
                leaders[len(out)] = leader
                if request.sampling.HasField("seed"):
                    fork.sampling.seed = (request.sampling.seed + i) % 2**64
            out.append(fork)
    return out, leaders


def batch_messages(
    run: Callable[[pb.GenerateRequest], Iterator[pb.GenerateResponse]],
    requests: Sequence[pb.GenerateRequest],
    width: int,
    call: HttpCall,
    leaders: Mapping[int, int] | None = None,
) -> Iterator[Indexed]:
    """The messages of ``run(request)`` for every request, as they come; the first error is raised.

    Args:
        run: one prompt's generation (the request path's ``generate``).
        width: how many run at once (>= 1).
        call: the HTTP request's call; ended here when the batch fails or is left early.
        leaders: request index -> the request whose first message it waits
            for (``forked``); the leaders are started first.
    """
    leaders = leaders or {}
    if len(requests) == 1:  # no threads for the common case
        for message in run(requests[0]):
            yield Indexed(0, message)
        return
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    led = {leader: threading.Event() for leader in leaders.values()}

    def one(index: int, request: pb.GenerateRequest) -> None:
        try:
            if index in leaders:
                led[leaders[index]].wait()
            if call.is_active():
                for message in run(request):
                    inbox.put((index, message))
                    if index in led:
                        led[index].set()
        except BaseException as exc:  # raised by the reader
            inbox.put((index, exc))
        finally:
            if index in led:
                led[index].set()  # a leader that failed or streamed nothing lets its forks go (or fail) too
            inbox.put((index, _DONE))

    pool = ThreadPoolExecutor(max(1, min(width, len(requests))), thread_name_prefix="gateway-http-batch")
    running = len(requests)
    try:
        # Leaders first: a pool thread that waits for a leader never holds up one.
        order = sorted(range(len(requests)), key=lambda i: i in leaders)
        for index in order:
            pool.submit(one, index, requests[index])
        while running:
            index, item = inbox.get()
            if item is _DONE:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield Indexed(index, item)
    finally:
        # A failure or a reader gone: the other prompts' engine requests stop now.
        if running:
            call.end()
        pool.shutdown(wait=False, cancel_futures=True)
