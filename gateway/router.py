"""Which engine replica serves a request: prefix affinity, bounded by load.

The ``affinity`` policy, for one request:

1. Candidates are the replicas whose gRPC health is SERVING.
2. The affinity target:
   - a templated request goes to the replica its template is pinned on (the
     keeper places it, see ``place``), else to the first replica of the
     template's rendezvous order;
   - any other request goes to the replica holding the longest run of the
     prompt's leading block hashes, as its daemon announced them (block
     events); when none holds its first block, to the first replica of the
     first block's rendezvous order, so that requests sharing a new prefix
     meet on one replica before any event says where it is;
   - a prompt without a full block has no affinity: the least loaded.
3. Load bound: a target already running ``load`` requests takes one more only
   while ``load + 1 <= factor * mean + slack``, ``mean`` being the requests in
   flight per candidate with this one counted; past that it spills to the
   least-loaded candidate (its cache misses cost less than the queue).

The ``round-robin`` policy takes the candidates in turn (a baseline).

Rendezvous (highest-random-weight) hashing ranks replicas by
``sha256(address ‖ key)``: every gateway ranks alike, and a replica that comes
or goes moves only the keys it ranks first.
"""

from __future__ import annotations

import hashlib
import itertools
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

POLICIES = ("affinity", "round-robin")

#: A block event as the router takes it: (kind, block hashes, tier), kind
#: one of "stored", "removed", "cleared".
Event = tuple[str, Sequence[bytes], int]


class NoReplica(LookupError):
    """No replica is serving."""


@dataclass(frozen=True)
class RouteKey:
    """What a request has that a replica may already hold.

    Attributes:
        template: ``tenant/name`` of the request's template, or "".
        block_hashes: the chained hashes of the prompt's leading full blocks,
            with the request's cache salt (as the daemon computes them).
    """

    template: str = ""
    block_hashes: tuple[bytes, ...] = ()


@dataclass(slots=True)
class ReplicaState:
    address: str
    serving: bool = False
    in_flight: int = 0
    #: block hash -> the tiers it is stored in: held while stored in any tier.
    held: dict[bytes, set[int]] = field(default_factory=dict)


@dataclass(frozen=True)
class ReplicaView:
    """A replica's state as ``Info`` shows it."""

    address: str
    serving: bool
    in_flight: int
    known_blocks: int  # blocks its daemon announced as cached


@dataclass(frozen=True)
class RouterConfig:
    """Attributes:
    policy: "affinity" or "round-robin".
    load_factor: how far above the mean load an affinity target may go.
    load_slack: requests a target may take above ``load_factor * mean``.
    """

    policy: str = "affinity"
    load_factor: float = 1.5
    load_slack: float = 2.0

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"routing policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.load_factor < 1.0:
            raise ValueError(f"load_factor must be >= 1, got {self.load_factor}")
        if self.load_slack < 0:
            raise ValueError(f"load_slack must be >= 0, got {self.load_slack}")


def rendezvous(key: bytes, addresses: Iterable[str]) -> list[str]:
    """``addresses`` ranked for ``key``, best first."""
    return sorted(addresses, key=lambda a: hashlib.sha256(a.encode() + b"\0" + key).digest(), reverse=True)


class Router:
    """The replicas' health, load and cached prefixes, and the choice among them.

    Thread-safe: RPC threads choose, the monitor and event relays update.
    """

    def __init__(self, config: RouterConfig = RouterConfig()) -> None:  # noqa: B008 (frozen)
        self.config = config
        self._replicas: dict[str, ReplicaState] = {}
        self._placed: dict[str, str] = {}  # template -> the replica it is pinned on
        self._turn = itertools.count()
        self._lock = threading.Lock()

    # ----------------------------------------------------------- replicas

    def set_replicas(self, addresses: Iterable[str]) -> None:
        """The replicas now (a DNS name resolves to others): new ones start not serving."""
        wanted = set(addresses)
        with self._lock:
            for address in wanted - self._replicas.keys():
                self._replicas[address] = ReplicaState(address)
            for address in self._replicas.keys() - wanted:
                del self._replicas[address]

    def set_serving(self, address: str, serving: bool) -> None:
        with self._lock:
            if (replica := self._replicas.get(address)) is not None:
                replica.serving = serving

    def serving(self) -> list[str]:
        with self._lock:
            return sorted(a for a, r in self._replicas.items() if r.serving)

    def addresses(self) -> list[str]:
        with self._lock:
            return sorted(self._replicas)

    def snapshot(self) -> list[ReplicaView]:
        with self._lock:
            return [
                ReplicaView(r.address, r.serving, r.in_flight, len(r.held))
                for r in sorted(self._replicas.values(), key=lambda r: r.address)
            ]

    # ------------------------------------------------------------- events

    def apply(self, address: str, events: Iterable[Event]) -> None:
        """Updates what ``address`` holds from its daemon's block events."""
        with self._lock:
            replica = self._replicas.get(address)
            if replica is None:
                return
            held = replica.held
            for kind, hashes, tier in events:
                if kind == "stored":
                    for h in hashes:
                        held.setdefault(h, set()).add(tier)
                elif kind == "removed":
                    for h in hashes:
                        tiers = held.get(h)
                        if tiers is not None:
                            tiers.discard(tier)
                            if not tiers:
                                del held[h]
                else:
                    held.clear()

    def forget(self, address: str) -> None:
        """Drops what ``address`` was known to hold (its event stream broke)."""
        self.apply(address, [("cleared", (), 0)])

    # ----------------------------------------------------------- templates

    def place(self, template: str, address: str | None) -> None:
        """Records the replica ``template`` is pinned on (None: nowhere)."""
        with self._lock:
            if address is None:
                self._placed.pop(template, None)
            else:
                self._placed[template] = address

    def placement(self, template: str) -> str | None:
        with self._lock:
            return self._placed.get(template)

    def template_order(self, template: str) -> list[str]:
        """The serving replicas in ``template``'s rendezvous order."""
        return rendezvous(template.encode(), self.serving())

    # -------------------------------------------------------------- choice

    def choose(self, key: RouteKey) -> str:
        """The replica for a request; count it with ``started``/``finished``.

        Raises:
            NoReplica: none is serving.
        """
        with self._lock:
            candidates = [r for r in self._replicas.values() if r.serving]
            if not candidates:
                known = ", ".join(sorted(self._replicas)) or "none"
                raise NoReplica(f"no engine replica is serving (replicas: {known})")
            candidates.sort(key=lambda r: r.address)
            if self.config.policy == "round-robin":
                return candidates[next(self._turn) % len(candidates)].address
            target = self._affinity(key, candidates)
            if target is None or self._over_bound(target, candidates):
                target = min(candidates, key=lambda r: r.in_flight)
            return target.address

    def started(self, address: str) -> None:
        with self._lock:
            if (replica := self._replicas.get(address)) is not None:
                replica.in_flight += 1

    def finished(self, address: str) -> None:
        with self._lock:
            if (replica := self._replicas.get(address)) is not None:
                replica.in_flight = max(0, replica.in_flight - 1)

    def _affinity(self, key: RouteKey, candidates: list[ReplicaState]) -> ReplicaState | None:
        by_address = {r.address: r for r in candidates}
        if key.template:
            placed = self._placed.get(key.template)
            if placed in by_address:
                return by_address[placed]
            return by_address[rendezvous(key.template.encode(), by_address)[0]]
        if not key.block_hashes:
            return None
        best, best_run = None, 0
        for replica in candidates:
            run = 0
            for h in key.block_hashes:
                if h not in replica.held:
                    break
                run += 1
            if run > best_run:
                best, best_run = replica, run
        return best or by_address[rendezvous(key.block_hashes[0], by_address)[0]]

    def _over_bound(self, target: ReplicaState, candidates: list[ReplicaState]) -> bool:
        mean = (sum(r.in_flight for r in candidates) + 1) / len(candidates)
        return target.in_flight + 1 > self.config.load_factor * mean + self.config.load_slack
