"""Cache marks: prefixes a request asks to keep pinned for a while once they
are computed (explicit caching, like Anthropic's ``cache_control``).

A request's marks (``NewRequest.cache_marks``, checked by
``kvd.common.cache_marks``, the engine's check too) wait with it in its
session (``Session.marked``) until the leading ``num_tokens // block_size``
blocks of its prompt are indexed: committed, or found cached at admission.
The session looks after a Step's commits (before its finished requests are
released: the Step that commits a prefill may also finish it) and after its
admissions, and only at requests that have marks: a Step without any costs
two dict checks. Each due mark is then pinned until ``now + ttl_seconds``
(``PinRegistry.pin_until``: the owner's quota, the pool's pin cap) or refused,
and reported once, in that Step's ``StepResponse.marks``.

The pin's id is ``mark:`` and its last block's hash, which chains the whole
prefix and the cache salt: it names the tenant's prefix, so the same prefix
marked again, by any request, refreshes one pin (its expiry becomes the later
of the two). Pins are not persisted: they end with the daemon (the disk tier
keeps the blocks).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvd.errors import CapacityError
from kvd.pins import PinRegistry
from kvd_api.daemon.v1 import daemon_pb2 as pb

if TYPE_CHECKING:
    from kvd.cache_request import Request
    from kvd.session import Session

#: ``MarkResult.refused``, beside the capacity errors' (kvd.pins: "... the
#: owner's pin quota of N blocks ...", "... the daemon's pin cap of N blocks ...").
SHORTER_THAN_A_BLOCK = "the prefix is shorter than one block"
ENDED = "the request ended before the prefix was computed"
NOT_CACHED = "the prefix is not in the cache (prefix caching is off, or its blocks were evicted)"

#: Prefix of an expiring pin's id made by a mark.
PIN_ID_PREFIX = "mark:"

#: One mark: (num_tokens, ttl_seconds).
Mark = tuple[int, int]


@dataclass(slots=True)
class PendingMarks:
    """A request's marks not pinned or refused yet, in increasing num_tokens."""

    marks: list[Mark]
    owner: str
    owner_max_blocks: int

    @classmethod
    def of(cls, msg: pb.CacheMarks) -> PendingMarks:
        """From a checked ``CacheMarks``."""
        return cls([(m.num_tokens, m.ttl_seconds) for m in msg.marks], msg.owner, msg.owner_max_blocks)


def ended(request: Request) -> list[pb.MarkResult]:
    """The results of a request's pending marks when it ends before them."""
    assert request.marks is not None
    return [result(request.request_id, mark, refused=ENDED) for mark in request.marks.marks]


def result(request_id: str, mark: Mark, num_pinned_tokens: int = 0, refused: str = "") -> pb.MarkResult:
    num_tokens, ttl_seconds = mark
    return pb.MarkResult(
        request_id=request_id,
        num_tokens=num_tokens,
        ttl_seconds=ttl_seconds,
        num_pinned_tokens=num_pinned_tokens,
        refused=refused,
    )


class Marker:
    """Pins requests' marks as their prefixes are indexed: one per daemon.

    Args:
        pins: the cache's pins.
        clock: the daemon's seconds, which expiries are read on.
        block_size: tokens per block.
    """

    def __init__(self, pins: PinRegistry, clock: Callable[[], float], block_size: int) -> None:
        self.pins = pins
        self.clock = clock
        self.block_size = block_size
        self.num_pinned = 0  # marks reported pinned (a refresh counts)
        self.num_refused = 0  # marks reported refused, the ended ones included

    def settle(self, session: Session) -> None:
        """Pins or refuses the due marks of ``session``'s marked requests;
        their results go to ``session.mark_results``."""
        now, bs, results = self.clock(), self.block_size, session.mark_results
        done = []
        for request in session.marked.values():
            pending = request.marks
            assert pending is not None, f"{request.request_id} is marked without marks"
            marks = pending.marks
            # NOTE: a waiting request has no blocks indexed: only its marks
            # shorter than a block are due (and refused).
            while marks and marks[0][0] // bs <= request.num_indexed_blocks:
                results.append(self._pin(request, pending, marks.pop(0), now))
            if not marks:
                done.append(request)
        for request in done:
            del session.marked[request.request_id]
            request.marks = None

    def count(self, results: list[pb.MarkResult]) -> None:
        """Counts a reply's results (metrics), the ended ones included."""
        refused = sum(1 for r in results if r.refused)
        self.num_refused += refused
        self.num_pinned += len(results) - refused

    def _pin(self, request: Request, pending: PendingMarks, mark: Mark, now: float) -> pb.MarkResult:
        num_blocks = mark[0] // self.block_size
        blocks = self.pins.pool.match_prefix(request.block_hashes[:num_blocks]) if num_blocks else []
        if not blocks:
            return result(request.request_id, mark, refused=NOT_CACHED if num_blocks else SHORTER_THAN_A_BLOCK)
        last_hash = blocks[-1].block_hash
        assert last_hash is not None
        try:
            pinned = self.pins.pin_until(
                PIN_ID_PREFIX + last_hash.hex(),
                request.block_hashes[: len(blocks)],
                now + mark[1],
                pending.owner,
                pending.owner_max_blocks,
            )
        except CapacityError as exc:
            return result(request.request_id, mark, refused=str(exc))
        return result(request.request_id, mark, len(pinned) * self.block_size)
