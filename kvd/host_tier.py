"""The host tier's bookkeeping: which host slot holds which block hash.

A second, larger pool of blocks in host memory behind the device pool. Blocks
that became full on the device are copied here after the step that wrote
them; a prompt whose next blocks miss the device but hit here gets device
blocks with these bytes copied back. This module only keeps the metadata (the
bytes and the copies are ``kvd.offload``'s): slots, their states, the hash
map and the LRU order, with the same chained hashes as the device pool.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kvd.block_pool import HOST, BlockRemoved, BlockStored


class SlotState(enum.Enum):
    FREE = "free"  # holds nothing
    WRITING = "writing"  # an outgoing copy is filling it: not readable, not reusable
    READY = "ready"  # holds a block's bytes: readable; reusable when nobody reads it


@dataclass(slots=True, eq=False)
class HostSlot:
    """One block-sized slot of host memory.

    Attributes:
        slot_id: index in the host tensor (dimension 0).
        block_hash: the hash of the content it holds or is receiving.
        writing: an outgoing copy (device to host) is filling it.
        readers: swap-ins (host to device) and disk writes copying out of
            it; a slot being read is never evicted.
        from_disk: its bytes were read back from the disk tier and no
            swap-in counted them yet (usage reports them as the disk's).
    """

    slot_id: int
    block_hash: bytes | None = None
    writing: bool = False
    readers: int = 0
    from_disk: bool = False

    @property
    def state(self) -> SlotState:
        if self.writing:
            return SlotState.WRITING
        return SlotState.FREE if self.block_hash is None else SlotState.READY


class HostTier:
    """Host slots, their hash map and LRU order.

    Args:
        num_slots: blocks the host tier holds.
        record: where stored/removed events of this tier go (the daemon's
            one event feed, so the order across tiers is kept).
    """

    def __init__(self, num_slots: int, record=None) -> None:
        if num_slots < 1:
            raise ValueError(f"the host tier needs >= 1 block, got {num_slots}")
        self.num_slots = num_slots
        self.slots = [HostSlot(i) for i in range(num_slots)]
        self._free = self.slots[::-1]  # a stack: slot 0 is used first
        # READY slots by hash, least recently used first.
        self.cached: OrderedDict[bytes, HostSlot] = OrderedDict()
        self.writing: dict[bytes, HostSlot] = {}
        self.num_evictions = 0
        self.num_read = 0  # slots with readers > 0
        self._record = record or (lambda event: None)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_in_copy(self) -> int:
        """Slots being written or read: while any is, the tier cannot be cleared."""
        return len(self.writing) + self.num_read

    def holds(self, block_hash: bytes) -> bool:
        """Stored here or on its way here."""
        return block_hash in self.cached or block_hash in self.writing

    # ------------------------------------------------------------ writing

    def reserve(self, block_hash: bytes) -> HostSlot | None:
        """A slot to copy a device block into (WRITING), evicting the least
        recently used unread block if none is free.

        Returns ``None`` when the hash is already here or on its way, or when
        every slot is being written or read.
        """
        if self.holds(block_hash):
            return None
        slot = self._free.pop() if self._free else self._evict_one()
        if slot is None:
            return None
        slot.block_hash = block_hash
        slot.writing = True
        slot.from_disk = False
        self.writing[block_hash] = slot
        return slot

    def abandon(self, slot: HostSlot) -> None:
        """Its copy failed (a disk block gone or corrupt): the slot is free again."""
        assert slot.writing and slot.block_hash is not None, f"{slot} was not being written"
        del self.writing[slot.block_hash]
        slot.writing = False
        slot.block_hash = None
        slot.from_disk = False
        self._free.append(slot)

    def written(self, slot: HostSlot) -> None:
        """Its copy finished: the slot serves hits from now on (most recent)."""
        assert slot.writing and slot.block_hash is not None, f"{slot} was not being written"
        slot.writing = False
        del self.writing[slot.block_hash]
        self.cached[slot.block_hash] = slot
        self._record(BlockStored((slot.block_hash,), HOST))

    def _evict_one(self) -> HostSlot | None:
        for block_hash, slot in self.cached.items():
            if slot.readers == 0:
                del self.cached[block_hash]
                slot.block_hash = None
                self.num_evictions += 1
                self._record(BlockRemoved((block_hash,), HOST))
                return slot
        return None

    # ------------------------------------------------------------ reading

    def begin_read(self, slots: Sequence[HostSlot]) -> None:
        """Swap-ins start copying out of ``slots``: they become most recent
        and cannot be evicted until :meth:`end_read`."""
        for slot in slots:
            assert slot.state is SlotState.READY, f"{slot} is not readable"
            if slot.readers == 0:
                self.num_read += 1
            slot.readers += 1
            self.cached.move_to_end(slot.block_hash)

    def end_read(self, slots: Sequence[HostSlot]) -> None:
        for slot in slots:
            assert slot.readers > 0, f"{slot} was not being read"
            slot.readers -= 1
            if slot.readers == 0:
                self.num_read -= 1

    # ------------------------------------------------------------ clearing

    def clear(self) -> int:
        """Forgets every stored block; only when no copy is in flight.

        Returns: the number of blocks dropped.
        """
        if self.num_in_copy:
            raise ValueError(f"{self.num_in_copy} host blocks are being copied")
        dropped = len(self.cached)
        for slot in self.cached.values():
            slot.block_hash = None
        self.cached.clear()
        self._free = self.slots[::-1]
        return dropped
