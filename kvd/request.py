"""What the daemon knows of one running request."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvd.block import Block


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
        token_ids: every token known so far (prompt, then sampled tokens).
        extra: the encoded hash namespaces (cache salt, extra keys).
        block_hashes: hashes of the full blocks of ``token_ids``, computed
            once, as blocks fill.
        blocks: the block table; append-only.
        num_computed_tokens: tokens whose K/V is written (committed).
        num_scheduled_tokens: tokens that have been given slots.
        num_cached_tokens: prefix tokens that were cache hits at admission.
        num_indexed_blocks: leading blocks already offered to the index.
        priority: smaller runs first; ties go by ``arrival``.
        arrival: the order in which its session received it.
        max_end: no position at or past this is ever scheduled (the prompt,
            plus the sampled tokens but the last, which is never computed).
        last_step: the session step that last scheduled it (-1: none).
    """

    request_id: str
    token_ids: list[int]
    extra: bytes
    block_hashes: list[bytes] = field(default_factory=list)
    blocks: list[Block] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_scheduled_tokens: int = 0
    num_cached_tokens: int = 0
    num_indexed_blocks: int = 0
    priority: int = 0
    arrival: int = 0
    max_end: int = 0
    last_step: int = -1

    @property
    def order(self) -> tuple[int, int]:
        """Its place in the schedule: priority, then arrival."""
        return (self.priority, self.arrival)
