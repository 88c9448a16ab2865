"""The block pool: every block, the free queue (an intrusive doubly linked
list whose order is the eviction order), and the prefix index."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from itertools import takewhile
from operator import is_not

from kvd.block import Block

#: ``block is not None`` as a C-level callable (``match_prefix``).
_is_block = partial(is_not, None)

#: The tiers a block can be stored in (events name them).
DEVICE = "device"
HOST = "host"
DISK = "disk"


class FreeBlockQueue:
    """Free blocks in eviction order: the head is evicted (reused) first.

    The links live in the blocks themselves (``prev_free``/``next_free``), so
    removing a block from the middle (a cache hit on a free cached block) is
    O(1) and no operation allocates. Two sentinels remove the edge cases.

    Order policy (the pool decides, the queue only keeps it):
      * a freed request's hashed blocks are appended at the tail in reverse,
        so its last blocks (least likely shared) are evicted first;
      * blocks holding nothing worth keeping go to the head, to be reused
        before any cached content is evicted.

        head ─► [empty][empty][b7][b6][b5] ... [b9][b8] ◄─ tail
               (reused first)        LRU ──────► MRU
    """

    def __init__(self, blocks: Iterable[Block] = ()) -> None:
        self._head = Block(block_id=-1)
        self._tail = Block(block_id=-2)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        self.append_n(blocks)

    def __len__(self) -> int:
        return self.num_free

    def __iter__(self) -> Iterator[Block]:
        node = self._head.next_free
        while node is not self._tail:
            assert node is not None
            yield node
            node = node.next_free

    @staticmethod
    def is_linked(block: Block) -> bool:
        return block.prev_free is not None

    def popleft(self) -> Block:
        """Removes and returns the head (the next block to reuse)."""
        block = self._head.next_free
        if block is self._tail or block is None:
            raise IndexError("no free blocks")
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[Block]:
        """Removes and returns the first ``n`` blocks, head first."""
        if n < 0:
            raise ValueError(f"cannot take {n} blocks")
        if n > self.num_free:
            raise IndexError(f"asked for {n} blocks, {self.num_free} free")
        taken = []
        node = self._head.next_free
        for _ in range(n):
            assert node is not None
            taken.append(node)
            nxt = node.next_free
            node.prev_free = node.next_free = None
            node = nxt
        self._head.next_free = node
        assert node is not None
        node.prev_free = self._head
        self.num_free -= n
        return taken

    def remove(self, block: Block) -> None:
        """Unlinks ``block`` from anywhere in the queue in O(1)."""
        self.remove_n((block,))

    def remove_n(self, blocks: Iterable[Block]) -> None:
        """Unlinks each of ``blocks``, wherever it is (one call for a request's blocks)."""
        count = 0
        try:
            for block in blocks:
                prev, nxt = block.prev_free, block.next_free
                assert prev is not None and nxt is not None, f"{block} is not in the free queue"
                prev.next_free = nxt
                nxt.prev_free = prev
                block.prev_free = block.next_free = None
                count += 1
        finally:
            self.num_free -= count

    def append(self, block: Block) -> None:
        """Links ``block`` at the tail (evicted last)."""
        self.append_n((block,))

    def appendleft(self, block: Block) -> None:
        """Links ``block`` at the head (reused first)."""
        self.appendleft_n((block,))

    def append_n(self, blocks: Iterable[Block]) -> None:
        """Links ``blocks`` at the tail, in order (the last is evicted last)."""
        self._link_run_before(self._tail, blocks)

    def appendleft_n(self, blocks: Iterable[Block]) -> None:
        """Links ``blocks`` at the head, in order (the first is reused first)."""
        nxt = self._head.next_free
        assert nxt is not None
        self._link_run_before(nxt, blocks)

    def _link_run_before(self, node: Block, blocks: Iterable[Block]) -> None:
        """Links ``blocks`` before ``node``, chained in one pass (a request's
        blocks are freed together: one call, not one per block)."""
        prev = node.prev_free
        assert prev is not None
        count = 0
        try:
            for block in blocks:
                # NOTE: these asserts are what keeps a double free from corrupting
                # the list (vLLM #42571): a linked or referenced block never enters twice.
                assert block.prev_free is None and block.next_free is None, f"{block} is already free"
                assert block.ref_cnt == 0, f"{block} is still referenced"
                prev.next_free = block
                block.prev_free = prev
                prev = block
                count += 1
        finally:  # a refused block leaves the ones before it linked, the list whole
            prev.next_free = node
            node.prev_free = prev
            self.num_free += count


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
        # NOTE: no Python call per block: a hot prompt walks ~100 hits here.
        return list(takewhile(_is_block, map(self.cached.get, block_hashes)))

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

    def touch(self, blocks: Sequence[Block], free: Sequence[Block] | None = None) -> None:
        """Takes one more reference on each block (a cache hit or a pin).

        A free block leaves the free queue, so it can no longer be evicted.
        ``free``: those of ``blocks`` that are free, when the caller has them.
        """
        self.free_queue.remove_n([block for block in blocks if block.ref_cnt == 0] if free is None else free)
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
