"""Pinned prefixes: blocks that are never evicted while a pin holds them.

Two kinds of pin share one cap (``max_pinned_blocks`` distinct blocks):
named pins (``pin``: templates, held until unpinned) and expiring pins
(``pin_until``: cache marks, kvd.marks, held until their expiry passes and
counted against their owner's quota too).
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from kvd.block import Block
from kvd.block_pool import BlockPool
from kvd.errors import CapacityError, NotFoundError


@dataclass(slots=True)
class ExpiringPin:
    """A pin held until ``expire_at`` (the daemon's clock), on ``owner``'s quota."""

    blocks: list[Block]
    expire_at: float
    owner: str


class PinRegistry:
    """Named and expiring pins over cached blocks, capped in total.

    A pin holds one reference on each of its blocks, so pinned blocks are
    never in the free queue and never evicted. Pins may share blocks (two
    templates with a common prefix); the cap counts distinct blocks, and so
    does each owner's quota.

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
        self.expiring: dict[str, ExpiringPin] = {}
        self._pin_counts: Counter[int] = Counter()  # block_id -> pins holding it
        self._owned: dict[str, Counter[int]] = {}  # owner -> block_id -> its expiring pins holding it
        # (expire_at, pin_id), one entry per expiring pin; a refreshed pin's
        # entry is pushed again at its new time when the old one comes up.
        self._expiries: list[tuple[float, str]] = []

    @property
    def num_pinned_blocks(self) -> int:
        return len(self._pin_counts)

    @property
    def num_pins(self) -> int:
        """Named and expiring pins."""
        return len(self.pins) + len(self.expiring)

    def owned_blocks(self, owner: str) -> int:
        """The distinct blocks ``owner``'s expiring pins hold."""
        return len(self._owned.get(owner, ()))

    # ------------------------------------------------------------ named

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
        """Releases a named pin; returns how many blocks it held."""
        blocks = self.pins.pop(pin_id, None)
        if blocks is None:
            raise NotFoundError(f"unknown pin {pin_id!r}")
        self._drop(blocks)
        return len(blocks)

    # --------------------------------------------------------- expiring

    def pin_until(
        self, pin_id: str, block_hashes: Sequence[bytes], expire_at: float, owner: str = "", owner_max_blocks: int = 0
    ) -> list[Block]:
        """Pins the cached prefix of ``block_hashes`` under ``pin_id`` until
        ``expire_at`` (``expire``), on ``owner``'s quota.

        An existing expiring pin of that id is refreshed: its expiry becomes
        the later of the two; its blocks and owner stay. NOTE: ids name
        content (kvd.marks: the last block's hash, which chains the prefix),
        so the same id is the same prefix, and a refresh pins nothing new.
        Expiring ids are apart from named ones (``pins``, ``unpin``).

        Args:
            owner_max_blocks: the most distinct blocks ``owner``'s expiring
                pins may hold together (0: no quota but the pool's cap).

        Raises:
            ValueError: an empty pin id.
            CapacityError: the owner's quota or ``max_pinned_blocks`` would be
                exceeded (the message names which); nothing changes.
        """
        if not pin_id:
            raise ValueError("pin_id must not be empty")
        held = self.expiring.get(pin_id)
        if held is not None:
            held.expire_at = max(held.expire_at, expire_at)
            return held.blocks
        blocks = self.pool.match_prefix(block_hashes)
        self._check_room(blocks, owner, owner_max_blocks)
        self.pool.touch(blocks)
        self._pin_counts.update(b.block_id for b in blocks)
        self._owned.setdefault(owner, Counter()).update(b.block_id for b in blocks)
        self.expiring[pin_id] = ExpiringPin(blocks, expire_at, owner)
        heapq.heappush(self._expiries, (expire_at, pin_id))
        return blocks

    def expire(self, now: float) -> int:
        """Unpins every expiring pin whose expiry passed; returns how many.
        Costs a comparison while none is due (the reaper calls it often)."""
        expiries, count = self._expiries, 0
        while expiries and expiries[0][0] <= now:
            _, pin_id = heapq.heappop(expiries)
            pin = self.expiring[pin_id]
            if pin.expire_at > now:  # refreshed since its entry was pushed
                heapq.heappush(expiries, (pin.expire_at, pin_id))
                continue
            del self.expiring[pin_id]
            self._disown(pin)
            self._drop(pin.blocks)
            count += 1
        return count

    def expiring_only_blocks(self) -> int:
        """The blocks held by expiring pins alone (no request, no named pin,
        no copy): those ``expire(math.inf)`` would free."""
        counts = Counter(b.block_id for pin in self.expiring.values() for b in pin.blocks)
        blocks = self.pool.blocks
        return sum(1 for block_id, n in counts.items() if blocks[block_id].ref_cnt == n)

    def _check_room(self, blocks: list[Block], owner: str, owner_max_blocks: int) -> None:
        owned = self._owned.get(owner, Counter())
        more = sum(1 for b in blocks if b.block_id not in owned)
        if owner_max_blocks and more and len(owned) + more > owner_max_blocks:
            raise CapacityError(
                f"{more} more blocks would exceed the owner's pin quota of {owner_max_blocks} blocks "
                f"(it holds {len(owned)})"
            )
        more = sum(1 for b in blocks if b.block_id not in self._pin_counts)
        if more and self.num_pinned_blocks + more > self.max_pinned_blocks:
            raise CapacityError(
                f"{more} more blocks would exceed the daemon's pin cap of {self.max_pinned_blocks} blocks "
                f"({self.num_pinned_blocks} are pinned)"
            )

    def _disown(self, pin: ExpiringPin) -> None:
        owned = self._owned[pin.owner]
        for block in pin.blocks:
            owned[block.block_id] -= 1
            if owned[block.block_id] == 0:
                del owned[block.block_id]
        if not owned:
            del self._owned[pin.owner]

    def _drop(self, blocks: list[Block]) -> None:
        for block in blocks:
            self._pin_counts[block.block_id] -= 1
            if self._pin_counts[block.block_id] == 0:
                del self._pin_counts[block.block_id]
        self.pool.release(blocks)
