"""The block pool: every block, the free queue, and the prefix index."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvd.block import Block
from kvd.free_queue import FreeBlockQueue

#: The tiers a block can be stored in (events name them).
DEVICE = "device"
HOST = "host"


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[bytes, ...]
    tier: str = DEVICE


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[bytes, ...]
    tier: str = DEVICE


@dataclass(frozen=True, slots=True)
class AllCleared:
    pass


BlockEvent = BlockStored | BlockRemoved | AllCleared


class BlockPool:
    """Owns all blocks of the cache and which of them hold which prefix.

    Only this class changes a block's ``ref_cnt``, ``block_hash`` or queue
    links. Callers get and give back blocks; capacity shortfalls return
    ``None``, misuse raises ``ValueError``, broken invariants ``assert``.

    Args:
        num_blocks: blocks in the cache.
        enable_caching: when False, committed blocks are never indexed (every
            lookup misses); used to measure the cache's worth.
        record_events: keep stored/removed/cleared events for ``take_events``.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True, record_events: bool = False) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.record_events = record_events
        self.blocks = [Block(block_id=i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[bytes, Block] = {}
        self.num_evictions = 0
        self.num_copying = 0  # blocks with pending_copies > 0 (kept, not scanned: Stats runs under the lock)
        self._events: list[BlockEvent] = []

    @property
    def num_free(self) -> int:
        return self.free_queue.num_free

    # ------------------------------------------------------------ lookups

    def match_prefix(self, block_hashes: Sequence[bytes]) -> list[Block]:
        """The cached blocks of the longest cached prefix; changes nothing."""
        hits = []
        cached = self.cached
        for block_hash in block_hashes:
            block = cached.get(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    # ------------------------------------------------------- allocation

    def allocate(self, n: int) -> list[Block] | None:
        """Takes ``n`` blocks from the head of the free queue (``ref_cnt=1``).

        Blocks that still held cached content are evicted: their hash leaves
        the index. Returns ``None`` when fewer than ``n`` blocks are free.

        Raises:
            ValueError: ``n`` is negative.
        """
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > self.free_queue.num_free:
            return None
        blocks = self.free_queue.popleft_n(n)
        evicted = []
        for block in blocks:
            assert block.pending_copies == 0, f"{block} handed out while a copy reads it"
            if block.block_hash is not None:
                del self.cached[block.block_hash]
                evicted.append(block.block_hash)
                block.block_hash = None
            block.ref_cnt = 1
        if evicted:
            self.num_evictions += len(evicted)
            if self.record_events:
                self._events.append(BlockRemoved(tuple(evicted)))
        return blocks

    def touch(self, blocks: Sequence[Block]) -> None:
        """Takes one more reference on each block (a cache hit or a pin).

        A free block leaves the free queue, so it can no longer be evicted.
        """
        self.free_queue.remove_n([block for block in blocks if block.ref_cnt == 0])
        for block in blocks:
            block.ref_cnt += 1

    def release(self, blocks: Sequence[Block]) -> None:
        """Drops one reference on each block of one request's block table.

        Blocks that reach zero are freed in reverse table order: hashed blocks
        to the tail (the table's tail is evicted first among them), empty
        blocks to the head (reused before any cached content is evicted).
        """
        to_tail: list[Block] = []  # hashed, in reverse table order
        to_head: list[Block] = []  # empty, in reverse table order
        try:
            for block in reversed(blocks):
                assert block.ref_cnt > 0, f"{block} released more often than taken"
                block.ref_cnt -= 1
                if block.ref_cnt == 0:
                    (to_head if block.block_hash is None else to_tail).append(block)
        finally:  # NOTE: the queue is linked per run, not per block (its cost at 100+ blocks)
            if to_tail:
                self.free_queue.append_n(to_tail)
            if to_head:
                to_head.reverse()  # linked at the head in table order: the last is reused last
                self.free_queue.appendleft_n(to_head)

    # ------------------------------------------------------------- copies

    def hold_for_copy(self, block: Block) -> None:
        """An outgoing copy starts reading ``block``: it is COPYING until
        :meth:`copy_finished`, and not handed out even if everyone else lets go."""
        self.touch((block,))
        if block.pending_copies == 0:
            self.num_copying += 1
        block.pending_copies += 1

    def copy_finished(self, block: Block) -> None:
        """The copy that :meth:`hold_for_copy` announced is done reading."""
        assert block.pending_copies > 0, f"{block} has no copy in flight"
        block.pending_copies -= 1
        if block.pending_copies == 0:
            self.num_copying -= 1
        self.release((block,))

    # ------------------------------------------------------------ caching

    def cache_blocks(self, blocks: Sequence[Block], block_hashes: Sequence[bytes]) -> list[Block]:
        """Indexes full, computed blocks under their hashes.

        A block whose content is already indexed (another request computed
        the same prefix concurrently) stays unindexed: duplicates are
        tolerated, the first copy serves future hits.

        Returns:
            The blocks indexed now (new content, not hits or duplicates).
        """
        if not self.enable_caching:
            return []
        new_blocks = []
        index = self.cached.setdefault
        for block, block_hash in zip(blocks, block_hashes, strict=True):
            if block.block_hash is not None:
                assert block.block_hash == block_hash, f"{block} re-hashed with other content"
                continue
            if index(block_hash, block) is block:  # a duplicate leaves the first copy indexed
                block.block_hash = block_hash
                new_blocks.append(block)
        if new_blocks and self.record_events:
            self._events.append(BlockStored(tuple(b.block_hash for b in new_blocks)))
        return new_blocks

    def reset(self) -> int:
        """Forgets every cached hash. Only allowed when no block is in use.

        Returns:
            The number of blocks whose content was dropped.

        Raises:
            ValueError: some block is still referenced.
        """
        in_use = self.num_blocks - self.num_free
        if in_use:
            raise ValueError(f"{in_use} blocks are in use")
        cleared = len(self.cached)
        for block in self.cached.values():
            block.block_hash = None
        self.cached.clear()
        if self.record_events:
            self._events.append(AllCleared())
        return cleared

    def record(self, event: BlockEvent) -> None:
        """Adds another tier's event to the feed, in order with the pool's."""
        if self.record_events:
            self._events.append(event)

    def take_events(self) -> list[BlockEvent]:
        events, self._events = self._events, []
        return events
