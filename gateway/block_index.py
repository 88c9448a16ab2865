"""Which replicas hold which blocks: one map per tier, block hash -> replica bitmask.

Each replica gets a slot (a bit). A block's entry is the bitmask of the slots
whose daemon announced it stored in that tier, so a fleet of replicas sharing
a block (a common system prompt) costs one entry, not one per replica, and a
lookup searches the request's blocks once for every replica together.

Beside the tiers, the blocks *promised* to a replica: those of requests sent
there whose prefill has not ended. A request queued behind them finds them
cached when its own prefill starts (a conversation's next turn that comes
before its previous one is prefilled), though no daemon has announced them yet.

Keys are the first 8 bytes of the daemon's 32-byte chained hash: a collision
(about 2^-64 per pair) could only make the router believe a block is cached
where it is not, which costs a worse choice, never a wrong answer (the daemon
checks full hashes). Most blocks live on one replica; their entries share that
replica's one-bit int, so an entry is the dict slot, the key and nothing else.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence

DEVICE, HOST, DISK = 0, 1, 2  # the daemon's Tier values
TIERS = (DEVICE, HOST, DISK)

_KEY = operator.itemgetter(slice(0, 8))


class BlockIndex:
    """Block hash -> the replica slots holding it, per tier. Not thread-safe (the router locks)."""

    def __init__(self) -> None:
        self._tiers: tuple[dict[bytes, int], ...] = tuple({} for _ in TIERS)
        self._bits: dict[int, int] = {}  # one-bit mask -> its shared int object
        self._counts: dict[tuple[int, int], int] = {}  # (slot, tier) -> blocks known
        self._promised: dict[bytes, int] = {}  # key -> the slots it is promised to
        self._promises: dict[tuple[bytes, int], int] = {}  # (key, slot) -> requests promising it

    # ------------------------------------------------------------ updates

    def stored(self, slot: int, tier: int, hashes: Iterable[bytes]) -> None:
        bit = self._bit(slot)
        held = self._tiers[tier]
        added = 0
        for key in map(_KEY, hashes):
            mask = held.get(key, 0)
            if not mask & bit:
                held[key] = mask | bit if mask else bit
                added += 1
        self._counts[slot, tier] = self._counts.get((slot, tier), 0) + added

    def removed(self, slot: int, tier: int, hashes: Iterable[bytes]) -> None:
        bit = self._bit(slot)
        held = self._tiers[tier]
        gone = 0
        for key in map(_KEY, hashes):
            mask = held.get(key, 0)
            if mask & bit:
                rest = mask & ~bit
                if rest:
                    held[key] = self._bits.get(rest, rest)
                else:
                    del held[key]
                gone += 1
        self._counts[slot, tier] = self._counts.get((slot, tier), 0) - gone

    def promise(self, slot: int, keys: Iterable[bytes]) -> None:
        """Blocks (``index_keys``) a request sent to ``slot`` will store there."""
        bit = self._bit(slot)
        for key in keys:
            n = self._promises.get((key, slot), 0)
            self._promises[key, slot] = n + 1
            if not n:
                self._promised[key] = self._promised.get(key, 0) | bit

    def unpromise(self, slot: int, keys: Iterable[bytes]) -> None:
        """That request's prefill ended (its blocks are stored, or it failed)."""
        bit = self._bit(slot)
        for key in keys:
            n = self._promises.pop((key, slot), 0)
            if n > 1:
                self._promises[key, slot] = n - 1
            elif n == 1 and (rest := self._promised.pop(key, 0) & ~bit):
                self._promised[key] = rest

    def num_promised(self) -> int:
        return len(self._promises)

    def clear(self, slot: int) -> None:
        """Forgets every block of ``slot`` (a scan of the index: rare, on a
        cache reset, a lost event stream or a replica leaving)."""
        bit = self._bit(slot)
        for tier, held in zip(TIERS, self._tiers, strict=True):
            if self._counts.pop((slot, tier), 0) == 0:
                continue
            for key, mask in list(held.items()):
                if mask & bit:
                    rest = mask & ~bit
                    if rest:
                        held[key] = self._bits.get(rest, rest)
                    else:
                        del held[key]

    def known(self, slot: int, tier: int | None = None) -> int:
        """Blocks ``slot`` is known to hold (in ``tier``, or in all tiers together)."""
        tiers = TIERS if tier is None else (tier,)
        return sum(self._counts.get((slot, t), 0) for t in tiers)

    def num_entries(self) -> int:
        return sum(len(held) for held in self._tiers)

    # ------------------------------------------------------------ lookups

    def has_disk_blocks(self) -> bool:
        return bool(self._tiers[DISK])

    def run_lengths(self, keys: Sequence[bytes], among: int, with_disk: bool = True) -> dict[int, int]:
        """slot -> how many of the leading blocks ``keys`` (``index_keys``) it
        holds in any tier (the disk's too unless ``with_disk`` is False) or is
        promised, for the slots of ``among`` that hold the first.

        A replica is taken to hold every block before one it holds: a daemon
        evicts a prompt's blocks from its tail, and a parent's hash is only
        cached while its prefix was. So the walk is a binary search for where
        the set of holders shrinks, once per distinct run length (a shared
        system prompt, then one conversation's replica: two searches), not a
        lookup of every block for every replica. A hole (a parent evicted
        before its child) only makes the estimate optimistic.
        """
        lengths: dict[int, int] = {}
        n = len(keys)
        held = self._held if with_disk else self._held_in_memory
        holders = held(keys[0]) & among if n else 0
        start = 0
        while holders:
            # The first block past ``start`` that not every one of ``holders`` holds.
            lo, hi = start + 1, n
            while lo < hi:
                mid = (lo + hi) // 2
                if held(keys[mid]) & holders == holders:
                    lo = mid + 1
                else:
                    hi = mid
            still = held(keys[lo]) & holders if lo < n else 0
            lost = holders & ~still
            while lost:
                low = lost & -lost
                lengths[low.bit_length() - 1] = lo
                lost ^= low
            holders, start = still, lo
        return lengths

    def _held(self, key: bytes) -> int:
        disk = self._tiers[DISK]
        mask = self._held_in_memory(key)
        return mask | disk.get(key, 0) if disk else mask

    def _held_in_memory(self, key: bytes) -> int:
        device, host, _ = self._tiers
        mask = device.get(key, 0) | host.get(key, 0) if host else device.get(key, 0)
        return mask | self._promised.get(key, 0) if self._promised else mask

    def _bit(self, slot: int) -> int:
        bit = 1 << slot
        return self._bits.setdefault(bit, bit)


def index_keys(hashes: Iterable[bytes]) -> tuple[bytes, ...]:
    """The index's keys of block hashes (computed once a request, with its hashes)."""
    return tuple(map(_KEY, hashes))
