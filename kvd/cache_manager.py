"""The block operations a session's scheduler asks for, request by request
(admit, append, commit, free) over the pool and its tiers; the request record
is kvd.cache_request's."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from kvd.block import Block
from kvd.block_pool import BlockPool
from kvd.cache_request import Request
from kvd.common.hashing import BlockHasher, encode_extra_keys, pack_tokens
from kvd.host_tier import HostSlot, HostTier

if TYPE_CHECKING:
    from kvd.disk_tier import DiskTier


@dataclass(frozen=True, slots=True)
class Admitted:
    """The outcome of a successful admission."""

    num_cached_tokens: int  # block-aligned prefix served by the cache (both tiers)
    num_host_cached_tokens: int  # of which copied back from the host tier
    num_disk_cached_tokens: int  # of those, read back from the disk tier
    first_position: int  # the first token to compute
    num_scheduled_tokens: int  # tokens to compute in this step
    blocks: list[Block]  # the whole block table, hits first


class Offload(NamedTuple):
    """A newly cached device block to copy into the host slot reserved for it."""

    block: Block
    slot: HostSlot


class SwapIn(NamedTuple):
    """A host-tier hit to copy into the device block given for it."""

    slot: HostSlot
    block: Block


class TierCopies(NamedTuple):
    """The copies queued since the last ``take_copies`` (kvd.offload runs them)."""

    offloads: list[Offload]
    swap_ins: list[SwapIn]


class Deferred:
    """``admit``'s answer for a request whose next block another request is computing."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "DEFERRED"


DEFERRED = Deferred()

#: Loads from the disk tier a request waits for at admission, at most: a
#: prompt longer than the host tier could otherwise wait forever, each load
#: evicting the one before (then it computes what is left).
MAX_DISK_LOADS = 4


class KVCacheManager:
    """Turns request-level questions into block-pool operations.

    It keeps no request registry: the caller (a session) owns its requests
    and passes them in. Capacity shortfalls return ``None``; bad arguments
    raise ``ValueError``.
    """

    def __init__(self, pool: BlockPool, block_size: int, host: HostTier | None = None) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.pool = pool
        self.block_size = block_size
        self.host = host
        self.disk: DiskTier | None = None  # set once the cache's model is known
        # Copies the caller must run after this call (see take_copies): new
        # full blocks to the host tier, host hits back to their new blocks.
        self.offloads: list[Offload] = []
        self.swap_ins: list[SwapIn] = []
        # The next block each running request will compute, by hash, while
        # it has known blocks left to compute: a newcomer whose next block is
        # one of these waits for it to be committed instead of computing a
        # duplicate (a burst of requests with one new long prefix computes it
        # once). One entry a request is enough: hashes chain, so a newcomer
        # sharing any block a request has still to compute shares that
        # request's next one, and misses there (every block before it is
        # committed, so indexed, while the request holds it).
        self.inflight: dict[bytes, Request] = {}
        self.query_tokens = 0
        self.hit_tokens = 0
        self.host_hit_tokens = 0
        self.disk_hit_tokens = 0

    # ----------------------------------------------------------- queries

    def new_request(
        self,
        request_id: str,
        token_ids: Sequence[int],
        cache_salt: bytes = b"",
        extra_keys: Sequence[bytes] = (),
    ) -> Request:
        """Validates a sequence and hashes its full blocks once."""
        if not token_ids:
            raise ValueError(f"request {request_id!r}: token_ids is empty")
        tokens = pack_tokens(token_ids)  # checks every id, once
        hasher = BlockHasher(encode_extra_keys(cache_salt, extra_keys), self.block_size)
        return Request(request_id=request_id, token_ids=tokens, hasher=hasher, block_hashes=hasher.advance(tokens))

    def device_cached_tokens(self, block_hashes: Sequence[bytes]) -> int:
        """Cached leading tokens (block-aligned) on the device for these hashes; no change."""
        return len(self.pool.match_prefix(block_hashes)) * self.block_size

    def cached_tokens(self, block_hashes: Sequence[bytes]) -> int:
        """Cached leading tokens (block-aligned) in either tier; no change."""
        return len(self.match_tiers(block_hashes)) * self.block_size

    # ---------------------------------------------------------- admission

    def admit(
        self, request: Request, token_budget: int, fence: list[Block] | None = None
    ) -> Admitted | Deferred | None:
        """Gives a new request its cached prefix and slots for one chunk.

        Prefix-aware: only uncached tokens count against ``token_budget`` and
        only blocks not already cached count against the pool. A fully cached
        prompt still computes its last token (to get logits), so at most
        ``len - 1`` tokens are taken from the cache. Blocks that miss the
        device but hit the host tier are cached too: they get device blocks,
        indexed at once, whose bytes are copied back before the engine runs
        (``swap_ins``); far cheaper than recomputing them.

        Args:
            fence: the caller's fenced blocks (see ``free``), taken before
                the pool's: the caller's next forward runs after the one
                that may still write into them.

        Returns:
            ``None`` when the budget is spent or the pool cannot hold the
            chunk; ``DEFERRED`` when its next block is being computed by
            another running request. Either way the request is unchanged and
            should wait.
        """
        assert not request.blocks, f"{request.request_id} is already admitted"
        num_tokens = len(request.token_ids)
        hashes = request.block_hashes
        reusable = request.reusable_hashes
        cached = self.match_tiers(reusable)
        hits = cached if self.host is None else [c for c in cached if isinstance(c, Block)]
        num_host_hits = len(cached) - len(hits)
        if len(cached) < len(reusable) and (
            reusable[len(cached)] in self.inflight or self._wait_for_disk(reusable[len(cached) :], request)
        ):
            return DEFERRED
        num_cached = len(cached) * self.block_size
        first = min(num_cached, num_tokens - 1)
        num_new = min(num_tokens - first, token_budget)
        if num_new <= 0:
            return None
        blocks_needed = max(0, self._blocks_for(first + num_new) - len(hits))
        # A free cached block that we hit leaves the free queue too.
        free_hits = [block for block in hits if block.ref_cnt == 0]
        if blocks_needed + len(free_hits) > self.pool.num_free + (len(fence) if fence else 0):
            return None
        self.pool.touch(hits, free_hits)
        new_blocks = self._allocate(blocks_needed, fence)
        assert new_blocks is not None, "capacity was checked above"
        num_disk_hits = 0
        if num_host_hits:
            request.blocks, num_disk_hits = self._swap_in(cached, hashes, new_blocks)
        else:
            request.blocks = hits + new_blocks
        request.num_cached_tokens = num_cached
        request.num_computed_tokens = first
        request.num_scheduled_tokens = first + num_new
        request.num_indexed_blocks = len(cached)
        if len(cached) < len(hashes):
            self.inflight.setdefault(hashes[len(cached)], request)
        host_tokens = num_host_hits * self.block_size
        disk_tokens = num_disk_hits * self.block_size
        self.query_tokens += num_tokens
        self.hit_tokens += num_cached
        self.host_hit_tokens += host_tokens
        self.disk_hit_tokens += disk_tokens
        return Admitted(num_cached, host_tokens, disk_tokens, first, num_new, request.blocks)

    def _wait_for_disk(self, rest: Sequence[bytes], request: Request) -> bool:
        """Whether the request's next block (``rest[0]``, the first of the
        reusable blocks the tiers above do not hold) is on its way from the
        disk tier, or on disk: then its run of blocks there starts loading
        into the host tier, and the request waits (a few times at most,
        MAX_DISK_LOADS)."""
        disk = self.disk
        if disk is None:
            return False
        if rest[0] in disk.loading:
            return True
        if request.disk_loads >= MAX_DISK_LOADS or not disk.holds(rest[0]):
            return False
        assert self.host is not None
        if disk.load(rest, limit=max(1, self.host.num_slots // 2)) == 0:
            return False
        request.disk_loads += 1
        return True

    def match_tiers(self, block_hashes: Sequence[bytes]) -> list[Block | HostSlot]:
        """The longest cached prefix, each block from the device if it is
        there, else from the host tier. (Device eviction is not prefix-ordered:
        a block may be gone from the device while a later one is still there.)"""
        hits: list[Block | HostSlot] = self.pool.match_prefix(block_hashes)
        if self.host is None or len(hits) == len(block_hashes):
            return hits
        on_device, on_host = self.pool.cached, self.host.cached
        for block_hash in block_hashes[len(hits) :]:
            source = on_device.get(block_hash) or on_host.get(block_hash)
            if source is None:
                break
            hits.append(source)
        return hits

    def _swap_in(
        self, cached: list[Block | HostSlot], hashes: Sequence[bytes], new_blocks: list[Block]
    ) -> tuple[list[Block], int]:
        """The block table, host hits given new device blocks that are indexed
        at once and queued to receive the slots' bytes (``swap_ins``); and how
        many of those slots were read back from disk for it."""
        assert self.host is not None
        fresh = iter(new_blocks)
        table: list[Block] = []
        swap_ins: list[SwapIn] = []
        swapped_hashes: list[bytes] = []
        for position, source in enumerate(cached):
            if isinstance(source, Block):
                table.append(source)
                continue
            block = next(fresh)
            swap_ins.append(SwapIn(source, block))
            swapped_hashes.append(hashes[position])
            table.append(block)
        table.extend(fresh)
        from_disk = 0
        for slot, _ in swap_ins:
            from_disk += slot.from_disk
            slot.from_disk = False  # counted once: a later hit on it is the host's
        self.host.begin_read([slot for slot, _ in swap_ins])
        self.pool.cache_blocks([block for _, block in swap_ins], swapped_hashes)
        self.swap_ins.extend(swap_ins)
        return table, from_disk

    def append(self, request: Request, num_tokens: int, fence: list[Block] | None = None) -> list[Block] | None:
        """Slots for a running request's next ``num_tokens`` tokens (``fence``:
        as for ``admit``).

        Returns:
            The blocks appended to its table (often none), or ``None`` when
            the pool is short: the caller preempts someone and retries.
        """
        if num_tokens < 1:
            raise ValueError(f"request {request.request_id!r}: num_tokens must be >= 1, got {num_tokens}")
        # NOTE: _blocks_for inlined: every running request's decode comes here, each Step.
        needed = -(-(request.num_scheduled_tokens + num_tokens) // self.block_size) - len(request.blocks)
        new_blocks: list[Block] = []
        if needed > 0:
            allocated = self._allocate(needed, fence)
            if allocated is None:
                return None
            new_blocks = allocated
            request.blocks.extend(new_blocks)
        request.num_scheduled_tokens += num_tokens
        return new_blocks

    # ------------------------------------------------------------- commit

    def check_commit(self, request: Request, num_computed_tokens: int, num_new_tokens: int) -> None:
        """Raises ``ValueError`` unless the commit's positions are consistent.

        The new token ids themselves are checked by ``commit`` (a Step checks
        all of its requests' in one go).
        """
        rid = request.request_id
        if num_computed_tokens < request.num_computed_tokens:
            raise ValueError(
                f"request {rid!r}: num_computed_tokens {num_computed_tokens} goes back "
                f"from {request.num_computed_tokens}"
            )
        if num_computed_tokens > request.num_scheduled_tokens:
            raise ValueError(
                f"request {rid!r}: num_computed_tokens {num_computed_tokens} exceeds the "
                f"{request.num_scheduled_tokens} tokens that have slots"
            )
        known = len(request.token_ids) + num_new_tokens
        if num_computed_tokens > known:
            raise ValueError(
                f"request {rid!r}: num_computed_tokens {num_computed_tokens} exceeds the {known} known tokens"
            )

    def commit(self, request: Request, num_computed_tokens: int, new_token_ids: Sequence[int] = ()) -> None:
        """Records a forward's results; blocks that became full enter the cache."""
        self.check_commit(request, num_computed_tokens, len(new_token_ids))
        self.apply_commit(request, num_computed_tokens, pack_tokens(new_token_ids).tolist())

    def apply_commit(self, request: Request, num_computed_tokens: int, new_token_ids: list[int]) -> None:
        """``commit`` without the checks, for callers that ran ``check_commit``
        (``new_token_ids``: a list, appended by the array's fast path)."""
        if new_token_ids:
            request.token_ids.fromlist(new_token_ids)
        request.num_computed_tokens = num_computed_tokens
        full = num_computed_tokens // self.block_size
        if full <= request.num_indexed_blocks:
            return
        hashes = request.block_hashes
        if len(hashes) < full:
            hashes.extend(request.hasher.advance(request.token_ids, full))
        start = request.num_indexed_blocks
        self._forget_inflight(request)
        stored = self.pool.cache_blocks(request.blocks[start:full], hashes[start:full])
        request.num_indexed_blocks = full
        if full < len(hashes):  # more of its prompt to compute: its next block
            self.inflight.setdefault(hashes[full], request)
        if self.host is not None and stored:
            self._offload(stored)

    def _offload(self, blocks: list[Block]) -> None:
        """Reserves host slots for newly cached blocks and holds each block
        (COPYING) right away: a free later in this same step must not let it
        be handed out before its bytes were read."""
        assert self.host is not None
        for block in blocks:
            assert block.block_hash is not None
            slot = self.host.reserve(block.block_hash)
            if slot is not None:
                self.pool.hold_for_copy(block)
                self.offloads.append(Offload(block, slot))

    def take_copies(self) -> TierCopies:
        """The copies queued since the last call."""
        copies = TierCopies(self.offloads, self.swap_ins)
        self.offloads, self.swap_ins = [], []
        return copies

    def free(self, request: Request, fence: list[Block] | None = None) -> None:
        """Gives back every block of a finished, cancelled or preempted request.

        Args:
            fence: given while the engine's forward may still write into the
                request's blocks: its blocks without a hash move here, their
                references with them, out of the pool's reach until the caller
                releases the fence (only the caller's own later allocations may
                take them: ``admit``, ``append``). Hashed blocks are released
                now: they are full and committed, and no forward writes into
                them (the engine writes only positions past its cached prefix).
        """
        self._forget_inflight(request)
        blocks = request.blocks
        if fence is not None:
            fence.extend([block for block in blocks if block.block_hash is None])
            blocks = [block for block in blocks if block.block_hash is not None]
        self.pool.release(blocks)
        request.blocks = []
        request.num_computed_tokens = request.num_scheduled_tokens = 0
        request.num_indexed_blocks = 0

    def _allocate(self, n: int, fence: list[Block] | None) -> list[Block] | None:
        """``n`` blocks, the fence's first (each keeps the reference the fence
        held), then the pool's; None when both together are short."""
        if not fence:
            return self.pool.allocate(n)
        if n > len(fence) + self.pool.num_free:
            return None
        taken = fence[:n]
        del fence[:n]
        rest = self.pool.allocate(n - len(taken))
        assert rest is not None, "capacity was checked above"
        return taken + rest

    def _forget_inflight(self, request: Request) -> None:
        """Drops the request's entry: its first block not indexed yet."""
        hashes, start = request.block_hashes, request.num_indexed_blocks
        if start < len(hashes) and self.inflight.get(hashes[start]) is request:
            del self.inflight[hashes[start]]

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)
