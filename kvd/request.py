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
