"""Which engine replica serves a request: the replicas' state, and the choice among them.

The ``Router`` holds what the gateway knows of each replica — its gRPC
health, its daemon's cached blocks (one ``BlockIndex`` for all replicas, fed
by their block events), its load (``gateway.replica_load``: reports and this
gateway's requests since), the template pinned there (``gateway.placement``)
— and asks its policy (``gateway.policies``: ``cost``, the default, by the
least estimated time to first token; ``affinity``; ``round-robin``) to choose
among the serving ones. The vocabulary (``RouteKey``, ``Route``, ``Load``,
``RouterConfig``) is in ``gateway.route_types``.

One lock guards all of it: RPC threads choose and count their requests; the
health monitor, the event watchers and the load watchers update.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence

from gateway.block_index import DEVICE, HOST, BlockIndex
from gateway.placement import TemplatePlacement, rendezvous
from gateway.policies import make_policy
from gateway.replica_load import ReplicaState, rate_terms
from gateway.route_types import (
    POLICIES,
    Cleared,
    Event,
    Load,
    NoReplica,
    Removed,
    ReplicaView,
    Route,
    RouteKey,
    RouterConfig,
    Stored,
)

__all__ = [
    "POLICIES",
    "Cleared",
    "Event",
    "Load",
    "NoReplica",
    "Removed",
    "ReplicaView",
    "Route",
    "RouteKey",
    "Router",
    "RouterConfig",
    "rendezvous",
    "Stored",
]

#: What a block on a replica's disk tier counts for against one in its memory
#: (device or host tier): reading it back is far cheaper than computing it,
#: but a memory hit is cheaper still (docs/benchmarks.md, the ``disk`` workload).
DISK_BLOCK_WEIGHT = 0.5


class Router:
    """The replicas' health, load and cached prefixes, and the choice among them.

    Thread-safe: RPC threads choose, the monitor and the event and load watchers update.

    Args:
        clock: seconds, monotonic (the simulator gives its own).
    """

    def __init__(self, config: RouterConfig = RouterConfig(), clock: Callable[[], float] = time.monotonic) -> None:  # noqa: B008
        self.config = config
        self._clock = clock
        self._replicas: dict[str, ReplicaState] = {}
        self._index = BlockIndex()
        self._placement = TemplatePlacement()
        self._policy = make_policy(config, self._placement)
        self._tickets = itertools.count(1)
        self._candidates: list[ReplicaState] | None = None  # the serving ones by address, until that changes
        self._among: int | None = None  # their slots' bits
        self._lock = threading.Lock()
        self._serving_changed = threading.Condition(self._lock)

    # ----------------------------------------------------------- replicas

    def set_replicas(self, addresses: Iterable[str]) -> None:
        """The replicas now (a DNS name resolves to others): new ones start not serving."""
        wanted = set(addresses)
        with self._lock:
            for address in self._replicas.keys() - wanted:
                gone = self._replicas.pop(address)
                self._index.clear(gone.slot)
                for _, _, promised in gone.pending.values():
                    self._index.unpromise(gone.slot, promised)
            used = {r.slot for r in self._replicas.values()}
            free = (s for s in itertools.count() if s not in used)
            for address in sorted(wanted - self._replicas.keys()):
                self._replicas[address] = ReplicaState(address, next(free), rate=rate_terms(None, self.config)[0])
            self._candidates = self._among = None

    def set_serving(self, address: str, serving: bool) -> bool:
        """Whether this changed what ``address`` was known to do."""
        with self._lock:
            if (replica := self._replicas.get(address)) is None or replica.serving == serving:
                return False
            replica.serving = serving
            if serving:
                replica.comebacks += 1
            else:
                replica.stopped_at = self._clock()
            self._candidates = self._among = None
            self._serving_changed.notify_all()
            return True

    def comebacks(self, address: str) -> int:
        """Times ``address`` started serving (see ``refusers``)."""
        with self._lock:
            replica = self._replicas.get(address)
            return replica.comebacks if replica is not None else 0

    def refusers(self, tried: Mapping[str, int]) -> set[str]:
        """Of the replicas a request tried (address -> its ``comebacks`` then),
        those that have not started serving anew since: a replica that refused
        it stays refused, a replaced one on the same address does not."""
        with self._lock:
            return self._refusers(tried)

    def _refusers(self, tried: Mapping[str, int]) -> set[str]:
        return {a for a, seen in tried.items() if (r := self._replicas.get(a)) is None or r.comebacks == seen}

    def served_within(self, seconds: float) -> bool:
        """Whether a replica serves, or one stopped serving less than ``seconds``
        ago (a drain or a restart under way: a replica is expected back)."""
        since = self._clock() - seconds
        with self._lock:
            return any(r.serving or r.stopped_at >= since for r in self._replicas.values())

    def wait_serving(self, tried: Mapping[str, int], timeout_s: float) -> bool:
        """Waits until a replica serves that is not one of ``tried``'s refusers;
        False when ``timeout_s`` passed first."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while True:
                refused = self._refusers(tried)
                if any(r.serving and a not in refused for a, r in self._replicas.items()):
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._serving_changed.wait(left)

    def serving(self) -> list[str]:
        with self._lock:
            return sorted(a for a, r in self._replicas.items() if r.serving)

    def set_cache(self, address: str, cache_id: str) -> None:
        """The daemon cache ``address`` is attached to (from its ``Info``)."""
        with self._lock:
            if (replica := self._replicas.get(address)) is not None:
                replica.cache_id = cache_id

    def cache_of(self, address: str | None) -> str:
        """The cache ``address`` is attached to ("": unknown, or no such replica)."""
        with self._lock:
            replica = self._replicas.get(address) if address is not None else None
            return replica.cache_id if replica is not None else ""

    def known_caches(self) -> set[str]:
        """The caches some replica (serving or not) was last seen attached to."""
        with self._lock:
            return {r.cache_id for r in self._replicas.values() if r.cache_id}

    def serving_by_cache(self) -> dict[str, list[str]]:
        """cache id -> its serving replicas by address (replicas of an unknown cache left out)."""
        with self._lock:
            caches: dict[str, list[str]] = {}
            for address, r in sorted(self._replicas.items()):
                if r.serving and r.cache_id:
                    caches.setdefault(r.cache_id, []).append(address)
            return caches

    def addresses(self) -> list[str]:
        with self._lock:
            return sorted(self._replicas)

    def snapshot(self) -> list[ReplicaView]:
        with self._lock:
            return [
                ReplicaView(
                    r.address,
                    r.serving,
                    r.in_flight,
                    self._index.known(r.slot, DEVICE),
                    self._index.known(r.slot, HOST),
                    r.load,
                )
                for r in sorted(self._replicas.values(), key=lambda r: r.address)
            ]

    # ------------------------------------------------------- events, load

    def record_events(self, address: str, events: Iterable[Event]) -> None:
        """Updates what ``address`` holds from its daemon's block events."""
        with self._lock:
            replica = self._replicas.get(address)
            if replica is None:
                return
            for event in events:
                match event:
                    case Stored(hashes, tier):
                        self._index.stored(replica.slot, tier, hashes)
                    case Removed(hashes, tier):
                        self._index.removed(replica.slot, tier, hashes)
                    case Cleared():
                        self._index.clear(replica.slot)

    def forget(self, address: str) -> None:
        """Drops what ``address`` was known to hold (its event stream broke)."""
        self.record_events(address, [Cleared()])

    def report_load(self, address: str, load: Load) -> None:
        with self._lock:
            if (replica := self._replicas.get(address)) is not None:
                replica.reported(load, self._clock(), self.config)

    def forget_load(self, address: str) -> None:
        """Its load stream broke: back to this gateway's own requests only."""
        with self._lock:
            if (replica := self._replicas.get(address)) is not None:
                replica.reported(None, self._clock(), self.config)

    # ----------------------------------------------------------- templates

    def place(self, template: str, address: str | None) -> None:
        """Records the replica ``template`` is pinned on (None: nowhere)."""
        with self._lock:
            self._placement.place(template, address)

    def placement(self, template: str) -> str | None:
        with self._lock:
            return self._placement.placed(template)

    def template_order(self, template: str) -> list[str]:
        """The serving replicas in ``template``'s rendezvous order."""
        return rendezvous(template.encode(), self.serving())

    # -------------------------------------------------------------- choice

    def choose(self, key: RouteKey) -> str:
        """The replica for a request (see ``route``)."""
        return self.route(key).address

    def route(self, key: RouteKey, exclude: Collection[str] = ()) -> Route:
        """The replica for a request; count it with ``started``/``finished``.

        Args:
            exclude: replicas not to choose (they refused this request).

        Raises:
            NoReplica: none is serving (or every one serving is excluded).
        """
        with self._lock:
            if self._candidates is None:
                self._candidates = sorted((r for r in self._replicas.values() if r.serving), key=lambda r: r.address)
            candidates = self._candidates
            if exclude:
                candidates = [r for r in candidates if r.address not in exclude]
            if not candidates:
                known = ", ".join(sorted(self._replicas)) or "none"
                raise NoReplica(f"no engine replica is serving (replicas: {known})")
            held = self._held_blocks(key, candidates, excluding=bool(exclude))
            target = self._policy.choose(key, candidates, held)
            run = held.get(target.slot, 0)
            return Route(target.address, key.uncached(run), key.keys[run:])

    def started(self, address: str, uncached_tokens: int = 0, new_keys: Sequence[bytes] = ()) -> int:
        """Counts a request sent to ``address``; returns its ticket for ``prefilled`` and ``finished``.

        Args:
            uncached_tokens, new_keys: its ``Route``'s: the prefill work it
                queues there, and the blocks it promises (see ``BlockIndex.promise``).
        """
        ticket = next(self._tickets)
        with self._lock:
            if (replica := self._replicas.get(address)) is not None:
                replica.sent(ticket, self._clock(), uncached_tokens, tuple(new_keys))
                self._policy.sent(uncached_tokens)
                self._index.promise(replica.slot, new_keys)
        return ticket

    def prefilled(self, address: str, ticket: int) -> None:
        """The request's first token came: its prefill no longer waits there."""
        with self._lock:
            if (replica := self._replicas.get(address)) is not None:
                self._index.unpromise(replica.slot, replica.drop(ticket, self.config.report_lag_s))

    def finished(self, address: str, ticket: int | None = None) -> None:
        with self._lock:
            if (replica := self._replicas.get(address)) is not None:
                replica.in_flight = max(0, replica.in_flight - 1)
                self._index.unpromise(replica.slot, replica.drop(ticket, self.config.report_lag_s))

    def _held_blocks(self, key: RouteKey, candidates: list[ReplicaState], excluding: bool = False) -> dict[int, int]:
        """slot -> the request's leading blocks held there (replicas holding none left out).

        A templated request's template counts as held on its home and on
        every replica of the home's cache (engines sharing its daemon)."""
        among = sum(1 << r.slot for r in candidates) if excluding else self._among
        if among is None:
            among = self._among = sum(1 << r.slot for r in candidates)
        held = self._index.run_lengths(key.keys, among) if key.keys else {}
        if held and self._index.has_disk_blocks():
            # A block on a replica's disk is read back, cheaper than computing
            # it, dearer than a block in its memory: it counts for a fraction.
            in_memory = self._index.run_lengths(key.keys, among, with_disk=False)
            held = {
                slot: in_memory.get(slot, 0) + round(DISK_BLOCK_WEIGHT * (n - in_memory.get(slot, 0)))
                for slot, n in held.items()
            }
        if key.template:
            home = self._placement.home(key.template, candidates)
            for r in candidates:
                if r is home or (home.cache_id and r.cache_id == home.cache_id):
                    held[r.slot] = max(held.get(r.slot, 0), key.template_blocks)
        return held
