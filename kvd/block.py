"""One KV-cache block's metadata."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class BlockState(enum.Enum):
    """Where a device block is in its life; derived from its counters.

    FREE      in the free queue: may be handed out (its cached content, if
              any, is then evicted).
    IN_USE    held by requests or pins only.
    COPYING   an outgoing copy to the host tier still reads it: it must not
              be handed to anyone else, whoever else holds it, until the copy
              finished (the rule whose breaking corrupts outputs under load).
    """

    FREE = "free"
    IN_USE = "in use"
    COPYING = "copying"


@dataclass(slots=True, eq=False)
class Block:
    """Metadata of one preallocated block of the paged KV cache.

    Attributes:
        block_id: index of the block in the cache tensor (dimension 0).
        ref_cnt: holders of the block: running requests and pins. A block with
            ``ref_cnt == 0`` sits in the free queue.
        block_hash: the hash of the block's tokens and all before them, set once the block
            is full and committed; ``None`` while it holds no cached content.
        pending_copies: outgoing copies to the host tier not finished yet;
            each holds one of the block's references, which is what keeps
            the block out of the free queue while it is read.
        prev_free, next_free: links of the intrusive free queue. Only
            ``FreeBlockQueue`` touches them.
    """

    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None
    pending_copies: int = 0
    prev_free: Block | None = None
    next_free: Block | None = None

    @property
    def state(self) -> BlockState:
        if self.pending_copies:
            return BlockState.COPYING
        return BlockState.IN_USE if self.ref_cnt else BlockState.FREE

    def __repr__(self) -> str:
        digest = self.block_hash.hex()[:8] if self.block_hash else None
        copying = f", copies={self.pending_copies}" if self.pending_copies else ""
        return f"Block(id={self.block_id}, ref={self.ref_cnt}, hash={digest}{copying})"
