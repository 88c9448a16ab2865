"""Which replicas hold which blocks: one map per tier, block hash -> replica bitmask.

Each replica gets a slot (a bit). A block's entry is the bitmask of the slots
whose daemon announced it stored in that tier, so a fleet of replicas sharing
a block (a common system prompt) costs one entry, not one per replica, and a
lookup walks the request's blocks once for every replica together.

Keys are the first 8 bytes of the daemon's 32-byte chained hash: a collision
(about 2^-64 per pair) could only make the router believe a block is cached
where it is not, which costs a worse choice, never a wrong answer (the daemon
checks full hashes). Most blocks live on one replica; their entries share that
replica's one-bit int, so an entry is the dict slot, the key and nothing else.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Iterable, Sequence

DEVICE, HOST = 0, 1
TIERS = (DEVICE, HOST)

_KEY = operator.itemgetter(slice(0, 8))


class BlockIndex:
    """Block hash -> the replica slots holding it, per tier. Not thread-safe (the router locks)."""

    def __init__(self) -> None:
        self._tiers: tuple[dict[bytes, int], ...] = tuple({} for _ in TIERS)
        self._bits: dict[int, int] = {}  # one-bit mask -> its shared int object
        self._counts: dict[tuple[int, int], int] = {}  # (slot, tier) -> blocks known

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

    def runs(self, hashes: Sequence[bytes], among: int) -> list[int]:
        """The masks of the replicas (within ``among``) holding each leading
        block with all the blocks before it, in any tier; it stops at the
        first block no one in ``among`` holds that way."""
        keys = list(map(_KEY, hashes))
        device, host = self._tiers
        held = map(device.get, keys, itertools.repeat(0))
        if host:
            held = map(operator.or_, held, map(host.get, keys, itertools.repeat(0)))
        return list(itertools.takewhile(bool, itertools.accumulate(held, operator.and_, initial=among)))[1:]

    def _bit(self, slot: int) -> int:
        bit = 1 << slot
        return self._bits.setdefault(bit, bit)


def run_length(runs: Sequence[int], bit: int) -> int:
    """How many leading blocks the replica of ``bit`` holds, given ``runs``
    (masks only lose bits along the walk, so a binary search finds it)."""
    lo, hi = 0, len(runs)
    while lo < hi:
        mid = (lo + hi) // 2
        if runs[mid] & bit:
            lo = mid + 1
        else:
            hi = mid
    return lo
