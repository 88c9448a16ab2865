"""Which engine replica serves a request: by estimated time to first token.

The ``cost`` policy (the default), for one request, among the replicas whose
gRPC health is SERVING:

1. The blocks each replica already holds: the longest run of the prompt's
   leading block hashes its daemon announced (in any tier), found by one walk
   over the request's blocks for every replica together (``BlockIndex``), and
   the blocks this gateway's requests sent there will store once their
   prefill ends (a conversation's next turn may come before that: queued
   behind its previous turn, it finds them cached); a templated request's
   template counts as held where it is pinned (the keeper places it, see
   ``place``), else on the first replica of its rendezvous order.
2. The time to first token each replica would give it: the prefill work queued
   there (the uncached prompt tokens of its waiting and prefilling requests, as
   its engine last reported them, plus this gateway's requests sent since) and
   this request's own uncached tokens, over the replica's measured prefill rate
   (a fixed time per forward plus a time per token). The request's own tokens
   weigh more than queued ones: they delay every request that will queue
   behind it there, in a steady state as many as it finds queued ahead. So
   the weight is the requests queued per replica: the fleet's queued tokens
   per replica over a request's uncached tokens (a moving mean of this
   gateway's requests); deep queues make a cache miss dear. ``work_weight``
   is its floor (near idle a cache miss is still paid again by the turns that
   follow, and a queue drains by itself).
3. The minimum wins; ties go to the template's replica, else by rendezvous
   order on the request's first block that not every candidate holds (a
   common system prompt says nothing: the conversation's own first block
   spreads new conversations evenly, and keeps a conversation's turns together).

The ``affinity`` policy (the previous default, kept as a baseline): the
template's replica, else the longest run (ties: the first by address), else
the first block's rendezvous order; bounded by load (a target running ``load``
requests takes one more while ``load + 1 <= factor * mean + slack``, past that
the least loaded). ``round-robin`` takes the candidates in turn.

Rendezvous (highest-random-weight) hashing ranks replicas by
``sha256(address ‖ key)``: every gateway ranks alike, and a replica that comes
or goes moves only the keys it ranks first.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from gateway.block_index import DEVICE, HOST, BlockIndex, index_keys

POLICIES = ("cost", "affinity", "round-robin")

#: A block event as the router takes it: (kind, block hashes, tier), kind
#: one of "stored", "removed", "cleared".
Event = tuple[str, Sequence[bytes], int]


#: the weight of a request sent in the moving mean of requests' uncached tokens
_WORK_EWMA = 0.01


class NoReplica(LookupError):
    """No replica is serving."""


@dataclass(frozen=True)
class RouteKey:
    """What a request has that a replica may already hold.

    Attributes:
        template: ``tenant/name`` of the request's template, or "".
        block_hashes: the chained hashes of the prompt's leading full blocks,
            with the request's cache salt (as the daemon computes them).
        num_tokens: the prompt's tokens (template included); 0: unknown, taken
            as the full blocks' tokens.
        block_size: tokens per block.
        template_blocks: the template's full blocks (the leading ones).
    """

    template: str = ""
    block_hashes: tuple[bytes, ...] = ()
    num_tokens: int = 0
    block_size: int = 16
    template_blocks: int = 0
    keys: tuple[bytes, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "keys", index_keys(self.block_hashes))


@dataclass(frozen=True)
class Load:
    """An engine's load report.

    Attributes:
        queued_tokens: uncached prompt tokens of its waiting and prefilling requests.
        running: requests it runs (prefilling or decoding).
        free_blocks: its daemon's free blocks.
        forward_s: measured fixed time of one forward pass.
        token_s: measured time per prompt token in a forward pass (0: not
            measured yet; the fleet's mean rate stands in).
        token_budget: tokens per forward (longer prompts take several).
    """

    queued_tokens: int = 0
    running: int = 0
    free_blocks: int = 0
    forward_s: float = 0.0
    token_s: float = 0.0
    token_budget: int = 0


@dataclass(frozen=True)
class Route:
    """A choice: where, the prompt tokens that replica will have to compute,
    and the index keys of the blocks it will store there (those it lacks)."""

    address: str
    uncached_tokens: int
    new_keys: tuple[bytes, ...] = field(default=(), compare=False, repr=False)


@dataclass(slots=True)
class ReplicaState:
    address: str
    slot: int
    serving: bool = False
    in_flight: int = 0
    load: Load | None = None
    load_at: float = -math.inf  # when the last report arrived
    #: this gateway's requests not yet past their first token: ticket ->
    #: (sent at, uncached tokens, the index keys of the blocks it will store)
    pending: dict[int, tuple[float, int, tuple[bytes, ...]]] = field(default_factory=dict)
    #: of those, the tokens sent after what the last load report covers
    uncovered: int = 0
    #: (reported queued tokens, forward_s, token_s, token budget): the estimate's terms
    rate: tuple[int, float, float, int] = (0, 0.0, 1.0, 1)
    measured: bool = False  # whether ``rate`` is its own (else the fleet's mean stands in)

    def covered_before(self, lag_s: float) -> float:
        return self.load_at - lag_s

    def recount(self, lag_s: float) -> None:
        covered = self.covered_before(lag_s)
        self.uncovered = sum(tokens for sent, tokens, _ in self.pending.values() if sent > covered)

    def drop(self, ticket: int | None, lag_s: float) -> tuple[bytes, ...]:
        """Forgets a pending request; returns the keys it promised."""
        entry = self.pending.pop(ticket, None)
        if entry is None:
            return ()
        if entry[0] > self.covered_before(lag_s):
            self.uncovered -= entry[1]
        return entry[2]


@dataclass(frozen=True)
class ReplicaView:
    """A replica's state as ``Info`` shows it."""

    address: str
    serving: bool
    in_flight: int
    known_blocks: int  # blocks its daemon announced as cached on the device
    known_host_blocks: int = 0  # ... and in its host tier
    load: Load | None = None


@dataclass(frozen=True)
class RouterConfig:
    """Attributes:
    policy: "cost", "affinity" or "round-robin".
    load_factor: how far above the mean load an affinity target may go.
    load_slack: requests a target may take above ``load_factor * mean``.
    work_weight: the least a request's own uncached token weighs against a
        queued one (cost policy; 1: the plain TTFT estimate); it weighs more
        while the fleet's queues are long (see ``Router._work_weight``).
    report_lag_s: a load report covers this gateway's requests sent at least
        this long before it arrived (the engine reports on change).
    forward_s, token_s, token_budget: the prefill rate assumed for a replica
        that has not reported one yet.
    """

    policy: str = "cost"
    load_factor: float = 1.5
    load_slack: float = 2.0
    work_weight: float = 4.0
    report_lag_s: float = 0.05
    forward_s: float = 0.02
    token_s: float = 1e-4
    token_budget: int = 2048

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"routing policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.load_factor < 1.0:
            raise ValueError(f"load_factor must be >= 1, got {self.load_factor}")
        if self.load_slack < 0:
            raise ValueError(f"load_slack must be >= 0, got {self.load_slack}")
        if self.work_weight <= 0:
            raise ValueError(f"work_weight must be > 0, got {self.work_weight}")
        if self.report_lag_s < 0 or self.forward_s < 0 or self.token_s <= 0 or self.token_budget < 1:
            raise ValueError("report_lag_s and forward_s must be >= 0, token_s > 0 and token_budget >= 1")


def _uncached(key: RouteKey, held_blocks: int) -> int:
    """The prompt tokens a replica holding ``held_blocks`` leading blocks computes
    (a fully cached prompt still computes its last token)."""
    return max(1, max(key.num_tokens, len(key.keys) * key.block_size) - held_blocks * key.block_size)


def rendezvous(key: bytes, addresses: Iterable[str]) -> list[str]:
    """``addresses`` ranked for ``key``, best first."""
    return sorted(addresses, key=lambda a: hashlib.sha256(a.encode() + b"\0" + key).digest(), reverse=True)


class Router:
    """The replicas' health, load and cached prefixes, and the choice among them.

    Thread-safe: RPC threads choose, the monitor and the event and load relays update.

    Args:
        clock: seconds, monotonic (the simulator gives its own).
    """

    def __init__(self, config: RouterConfig = RouterConfig(), clock: Callable[[], float] = time.monotonic) -> None:  # noqa: B008
        self.config = config
        self._clock = clock
        self._replicas: dict[str, ReplicaState] = {}
        self._index = BlockIndex()
        self._placed: dict[str, str] = {}  # template -> the replica it is pinned on
        self._turn = itertools.count()
        self._tickets = itertools.count(1)
        self._candidates: list[ReplicaState] | None = None  # the serving ones by address, until that changes
        self._among: int | None = None  # their slots' bits
        self._lock = threading.Lock()
        self._mean_work = 0.0  # uncached tokens of a request sent, a moving mean (0: none yet)

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
                self._replicas[address] = ReplicaState(address, next(free), rate=self._rate(None)[0])
            self._candidates = self._among = None

    def set_serving(self, address: str, serving: bool) -> None:
        with self._lock:
            if (replica := self._replicas.get(address)) is not None and replica.serving != serving:
                replica.serving = serving
                self._candidates = self._among = None

    def serving(self) -> list[str]:
        with self._lock:
            return sorted(a for a, r in self._replicas.items() if r.serving)

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

    def apply(self, address: str, events: Iterable[Event]) -> None:
        """Updates what ``address`` holds from its daemon's block events."""
        with self._lock:
            replica = self._replicas.get(address)
            if replica is None:
                return
            for kind, hashes, tier in events:
                if kind == "stored":
                    self._index.stored(replica.slot, tier, hashes)
                elif kind == "removed":
                    self._index.removed(replica.slot, tier, hashes)
                else:
                    self._index.clear(replica.slot)

    def forget(self, address: str) -> None:
        """Drops what ``address`` was known to hold (its event stream broke)."""
        self.apply(address, [("cleared", (), 0)])

    def report_load(self, address: str, load: Load) -> None:
        with self._lock:
            if (replica := self._replicas.get(address)) is not None:
                replica.load, replica.load_at = load, self._clock()
                replica.recount(self.config.report_lag_s)
                replica.rate, replica.measured = self._rate(load)

    def forget_load(self, address: str) -> None:
        """Its load stream broke: back to this gateway's own requests only."""
        with self._lock:
            if (replica := self._replicas.get(address)) is not None:
                replica.load, replica.load_at = None, -math.inf
                replica.recount(self.config.report_lag_s)
                replica.rate, replica.measured = self._rate(None)

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
        """The replica for a request (see ``route``)."""
        return self.route(key).address

    def route(self, key: RouteKey) -> Route:
        """The replica for a request; count it with ``started``/``finished``.

        Raises:
            NoReplica: none is serving.
        """
        with self._lock:
            if self._candidates is None:
                self._candidates = sorted((r for r in self._replicas.values() if r.serving), key=lambda r: r.address)
            candidates = self._candidates
            if not candidates:
                known = ", ".join(sorted(self._replicas)) or "none"
                raise NoReplica(f"no engine replica is serving (replicas: {known})")
            held = self._held_blocks(key, candidates)
            if self.config.policy == "round-robin":
                target = candidates[next(self._turn) % len(candidates)]
            elif self.config.policy == "affinity":
                target = self._affinity(key, candidates, held)
            else:
                target = self._cheapest(key, candidates, held)
            run = held.get(target.slot, 0)
            return Route(target.address, _uncached(key, run), key.keys[run:])

    def started(self, address: str, uncached_tokens: int = 0, new_keys: Sequence[bytes] = ()) -> int:
        """Counts a request sent to ``address``; returns its ticket for ``prefilled`` and ``finished``.

        Args:
            uncached_tokens, new_keys: its ``Route``'s: the prefill work it
                queues there, and the blocks it promises (see ``BlockIndex.promise``).
        """
        ticket = next(self._tickets)
        with self._lock:
            if (replica := self._replicas.get(address)) is not None:
                replica.in_flight += 1
                replica.pending[ticket] = (self._clock(), uncached_tokens, tuple(new_keys))
                replica.uncovered += uncached_tokens
                self._mean_work += (uncached_tokens - self._mean_work) * (_WORK_EWMA if self._mean_work else 1.0)
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

    # ------------------------------------------------------------ policies

    def _held_blocks(self, key: RouteKey, candidates: list[ReplicaState]) -> dict[int, int]:
        """slot -> the request's leading blocks held there (replicas holding none left out)."""
        if self._among is None:
            self._among = sum(1 << r.slot for r in candidates)
        held = self._index.run_lengths(key.keys, self._among) if key.keys else {}
        if key.template:
            home = self._template_home(key.template, candidates)
            held[home.slot] = max(held.get(home.slot, 0), key.template_blocks)
        return held

    def _cheapest(self, key: RouteKey, candidates: list[ReplicaState], held: dict[int, int]) -> ReplicaState:
        """The least estimated time to first token: the prefill work queued
        there and this request's uncached tokens (weighted) over its rate."""
        tokens = max(key.num_tokens, len(key.keys) * key.block_size)
        # Prefill work queued on each: as last reported, plus what this gateway sent since.
        queued_tokens = [r.rate[0] + r.uncovered for r in candidates]
        weight = self._work_weight(sum(queued_tokens) / len(candidates))
        fleet = None if all(r.measured for r in candidates) else self._fleet_rate(candidates)
        # A prefix most of the fleet holds (a common system prompt) counts as
        # held everywhere: a replica that lacks it computes it once and then
        # holds it too; counted against it, a new or emptied replica would
        # never be chosen while the others have less than that queued.
        half = len(candidates) // 2
        common = sorted(held.values(), reverse=True)[half] if len(held) > half else 0
        best, tied = math.inf, []
        for r, queued in zip(candidates, queued_tokens, strict=True):
            uncached = max(1, tokens - max(held.get(r.slot, 0), common) * key.block_size)
            _, forward_s, token_s, budget = r.rate
            if fleet is not None and not r.measured:
                forward_s, token_s = fleet
            cost = -(-(queued + uncached) // budget) * forward_s + (queued + weight * uncached) * token_s
            if cost < best - 1e-9:  # equal estimates may differ in the last bits
                best, tied = cost, [r]
            elif cost <= best + 1e-9:
                tied.append(r)
        if len(tied) == 1:
            return tied[0]
        if key.template:  # where it is pinned: it stays cached there
            home = self._template_home(key.template, candidates)
            if home in tied:
                return home
        tie_key = self._tie_key(key, held, len(candidates), common)
        if tie_key is None:
            return tied[next(self._turn) % len(tied)]
        first = rendezvous(tie_key, (r.address for r in tied))[0]
        return next(r for r in tied if r.address == first)

    def _work_weight(self, queued_per_replica: float) -> float:
        """How much this request's own uncached token weighs against a queued one.

        Its work delays every request that will queue behind it: as many, in
        a steady state, as it finds queued ahead of it, which is the fleet's
        queued tokens per replica over a request's uncached tokens (a moving
        mean of this gateway's). Near idle few do, and ``work_weight`` (a miss
        is paid again by the turns that follow) holds.
        """
        if self._mean_work <= 0:
            return self.config.work_weight
        return max(self.config.work_weight, queued_per_replica / self._mean_work)

    def _rate(self, load: Load | None) -> tuple[tuple[int, float, float, int], bool]:
        """The estimate's terms from a report, and whether its rate was measured."""
        cfg = self.config
        if load is None:
            return (0, cfg.forward_s, cfg.token_s, cfg.token_budget), False
        budget = load.token_budget if load.token_budget > 0 else cfg.token_budget
        if load.token_s > 0:
            return (load.queued_tokens, load.forward_s, load.token_s, budget), True
        return (load.queued_tokens, cfg.forward_s, cfg.token_s, budget), False

    def _fleet_rate(self, candidates: list[ReplicaState]) -> tuple[float, float] | None:
        """The mean measured (forward_s, token_s) of the candidates, for those not measured yet:
        a replica that never ran must not look faster, or slower, than the ones that did."""
        measured = [r.rate for r in candidates if r.measured]
        if not measured:
            return None
        return sum(m[1] for m in measured) / len(measured), sum(m[2] for m in measured) / len(measured)

    def _tie_key(self, key: RouteKey, held: dict[int, int], num_candidates: int, common: int = 0) -> bytes | None:
        """The request's first block that not every candidate (nor most of
        them: ``common`` blocks) holds (None: no blocks)."""
        if key.template and not key.block_hashes:
            return key.template.encode()
        if not key.block_hashes:
            return None
        everywhere = min(held.values()) if len(held) == num_candidates else 0
        return key.block_hashes[min(max(everywhere, common), len(key.block_hashes) - 1)]

    def _template_home(self, template: str, candidates: list[ReplicaState]) -> ReplicaState:
        by_address = {r.address: r for r in candidates}
        placed = self._placed.get(template)
        if placed in by_address:
            return by_address[placed]
        return by_address[rendezvous(template.encode(), by_address)[0]]

    def _affinity(self, key: RouteKey, candidates: list[ReplicaState], held: dict[int, int]) -> ReplicaState:
        if key.template:
            target = self._template_home(key.template, candidates)
        elif not key.block_hashes:
            target = None
        else:
            best = max(held.values(), default=0)
            if best:  # the longest run; ties to the first by address
                target = next(r for r in candidates if held.get(r.slot, 0) == best)
            else:
                first = rendezvous(key.block_hashes[0], (r.address for r in candidates))[0]
                target = next(r for r in candidates if r.address == first)
        if target is None or self._over_bound(target, candidates):
            target = min(candidates, key=lambda r: r.in_flight)
        return target

    def _over_bound(self, target: ReplicaState, candidates: list[ReplicaState]) -> bool:
        mean = (sum(r.in_flight for r in candidates) + 1) / len(candidates)
        return target.in_flight + 1 > self.config.load_factor * mean + self.config.load_slack
