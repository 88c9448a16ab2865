"""One KV-cache block's metadata."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, eq=False)
class Block:
    """Metadata of one preallocated block of the paged KV cache.

    Attributes:
        block_id: index of the block in the cache tensor (dimension 0).
        ref_cnt: holders of the block: running requests and pins. A block with
            ``ref_cnt == 0`` sits in the free queue.
        block_hash: the chained hash of the block's tokens, set once the block
            is full and committed; ``None`` while it holds no cached content.
        prev_free, next_free: links of the intrusive free queue. Only
            ``FreeBlockQueue`` touches them.
    """

    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None
    prev_free: Block | None = None
    next_free: Block | None = None

    def __repr__(self) -> str:
        digest = self.block_hash.hex()[:8] if self.block_hash else None
        return f"Block(id={self.block_id}, ref={self.ref_cnt}, hash={digest})"
