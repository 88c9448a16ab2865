"""What the daemon knows of one request holding blocks, and its place in the schedule."""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from operator import attrgetter
from typing import TYPE_CHECKING

from kvd.block import Block
from kvd.common.hashing import BlockHasher

if TYPE_CHECKING:
    from kvd.marks import PendingMarks


@dataclass(slots=True, eq=False)
class Request:
    """A request holding blocks.

    Token positions, for a block size of 4::

        tokens     |t0 t1 t2 t3|t4 t5 t6 t7|t8 t9 .. ..|
        blocks     [    b3     ][    b9    ][   b1     ]
                   └─ computed (K/V written, committed) ─┘
                   └──────── scheduled (have slots) ──────────┘

    Attributes:
        request_id: the engine's id, unique within its session.
        token_ids: every token known so far (prompt, then sampled tokens),
            packed (4 bytes a token: a long prompt may wait a while).
        hasher: the running hash of its full blocks (its namespaces: cache
            salt, extra keys), which hashes each further block as it fills.
        block_hashes: hashes of the full blocks of ``token_ids``, computed
            once, as blocks fill.
        blocks: the block table; append-only.
        num_computed_tokens: tokens whose K/V is written (committed).
        num_scheduled_tokens: tokens that have been given slots.
        num_cached_tokens: prefix tokens that were cache hits at admission.
        num_indexed_blocks: leading blocks already offered to the index.
        priority: smaller runs first; ties go by ``arrival``.
        arrival: the order in which its session received it.
        order: its place in the schedule (priority, then arrival), set by ``queued``.
        max_end: no position at or past this is ever scheduled (the prompt,
            plus the sampled tokens but the last, which is never computed).
        last_step: the session step that last scheduled it (-1: none).
        disk_loads: loads from the disk tier it waited for at admission.
        max_cached_blocks: the most leading blocks admission takes from the
            cache (None: all it holds); the rest are computed again, for
            their logits (a prompt's logprobs).
        marks: its cache marks not pinned or refused yet (kvd.marks; None: none).
    """

    request_id: str
    token_ids: array  # of 'I'
    hasher: BlockHasher
    block_hashes: list[bytes] = field(default_factory=list)
    blocks: list[Block] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_scheduled_tokens: int = 0
    num_cached_tokens: int = 0
    num_indexed_blocks: int = 0
    priority: int = 0
    arrival: int = 0
    order: int = 0
    max_end: int = 0
    last_step: int = -1
    disk_loads: int = 0
    max_cached_blocks: int | None = None
    marks: PendingMarks | None = None

    @property
    def reusable_hashes(self) -> list[bytes]:
        """The hashes of the blocks the cache may serve it."""
        limit = self.max_cached_blocks
        return self.block_hashes if limit is None else self.block_hashes[:limit]

    def queued(self, arrival: int) -> None:
        """Its session received it ``arrival``-th: its place in the schedule is set."""
        self.arrival = arrival
        # NOTE: (priority, arrival) as one int (exact below 2**40 arrivals a
        # session): a decode Step sorts every running request by it, and an
        # int compares without building a tuple per request.
        self.order = (self.priority << 40) + arrival


#: ``Request.order`` as a key function: an attrgetter, so sorting and
#: bisecting a Step's requests make no Python call per request.
schedule_order = attrgetter("order")
