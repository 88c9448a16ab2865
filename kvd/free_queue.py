"""The free-block queue: an intrusive doubly linked list whose order is the
eviction order."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from kvd.block import Block


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
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, f"{block} is not in the free queue"
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def remove_n(self, blocks: Iterable[Block]) -> None:
        """Unlinks each of ``blocks`` (``remove`` without a call per block)."""
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
        self._link_before(self._tail, block)

    def appendleft(self, block: Block) -> None:
        """Links ``block`` at the head (reused first)."""
        nxt = self._head.next_free
        assert nxt is not None
        self._link_before(nxt, block)

    def append_n(self, blocks: Iterable[Block]) -> None:
        """Links ``blocks`` at the tail, in order (the last is evicted last)."""
        self._link_run_before(self._tail, blocks)

    def appendleft_n(self, blocks: Iterable[Block]) -> None:
        """Links ``blocks`` at the head, in order (the first is reused first)."""
        nxt = self._head.next_free
        assert nxt is not None
        self._link_run_before(nxt, blocks)

    def _link_before(self, node: Block, block: Block) -> None:
        # NOTE: these asserts are what keeps a double free from corrupting the
        # list (vLLM #42571): a linked or referenced block never enters twice.
        assert block.prev_free is None and block.next_free is None, f"{block} is already free"
        assert block.ref_cnt == 0, f"{block} is still referenced"
        prev = node.prev_free
        assert prev is not None
        prev.next_free = block
        block.prev_free = prev
        block.next_free = node
        node.prev_free = block
        self.num_free += 1

    def _link_run_before(self, node: Block, blocks: Iterable[Block]) -> None:
        """``_link_before`` for a run of blocks, chained in one pass (a
        request's blocks are freed together: one call, not one per block)."""
        prev = node.prev_free
        assert prev is not None
        count = 0
        try:
            for block in blocks:
                # NOTE: the same double-free guards as _link_before.
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
