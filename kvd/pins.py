"""Pinned prefixes: blocks that are never evicted while a pin holds them."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from kvd.block import Block
from kvd.block_pool import BlockPool
from kvd.errors import CapacityError, NotFoundError


class PinRegistry:
    """Named pins over cached blocks, capped in total.

    A pin holds one reference on each of its blocks, so pinned blocks are
    never in the free queue and never evicted. Pins may share blocks (two
    templates with a common prefix); the cap counts distinct blocks.

    Args:
        pool: the block pool.
        max_pinned_blocks: the most distinct blocks pins may hold together.
    """

    def __init__(self, pool: BlockPool, max_pinned_blocks: int) -> None:
        if max_pinned_blocks < 0:
            raise ValueError(f"max_pinned_blocks must be >= 0, got {max_pinned_blocks}")
        self.pool = pool
        self.max_pinned_blocks = max_pinned_blocks
        self.pins: dict[str, list[Block]] = {}
        self._pin_counts: Counter[int] = Counter()  # block_id -> pins holding it

    @property
    def num_pinned_blocks(self) -> int:
        return len(self._pin_counts)

    def pin(self, pin_id: str, block_hashes: Sequence[bytes]) -> list[Block]:
        """Pins the cached prefix of ``block_hashes`` under ``pin_id``.

        Pinning an existing id replaces its blocks (idempotent for the same
        prefix). Only the leading cached blocks are pinned.

        Raises:
            ValueError: an empty pin id.
            CapacityError: the pin would exceed ``max_pinned_blocks``; nothing
                changes.
        """
        if not pin_id:
            raise ValueError("pin_id must not be empty")
        blocks = self.pool.match_prefix(block_hashes)
        old = self.pins.get(pin_id, [])
        old_only = {b.block_id for b in old if self._pin_counts[b.block_id] == 1}
        new_only = {b.block_id for b in blocks if b.block_id not in self._pin_counts}
        total = self.num_pinned_blocks - len(old_only - {b.block_id for b in blocks}) + len(new_only)
        if total > self.max_pinned_blocks:
            raise CapacityError(
                f"pinning {len(blocks)} blocks for {pin_id!r} would hold {total} pinned blocks; "
                f"the cap is {self.max_pinned_blocks}"
            )
        # Take the new references before dropping the old ones, so blocks in
        # both never pass through the free queue.
        self.pool.touch(blocks)
        self._pin_counts.update(b.block_id for b in blocks)
        if old:
            self._drop(old)
        self.pins[pin_id] = blocks
        return blocks

    def unpin(self, pin_id: str) -> int:
        """Releases a pin; returns how many blocks it held."""
        blocks = self.pins.pop(pin_id, None)
        if blocks is None:
            raise NotFoundError(f"unknown pin {pin_id!r}")
        self._drop(blocks)
        return len(blocks)

    def _drop(self, blocks: list[Block]) -> None:
        for block in blocks:
            self._pin_counts[block.block_id] -= 1
            if self._pin_counts[block.block_id] == 0:
                del self._pin_counts[block.block_id]
        self.pool.release(blocks)
