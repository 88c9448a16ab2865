"""The routing policies: which candidate replica a request goes to.

Each policy is a small object with ``choose(key, candidates, held)``: the
serving replicas by address, and for each (by its slot) the request's leading
blocks it holds (``Router`` computes them; a templated request's template
counts as held on its home). The ``Router`` owns the policy and calls it
under its lock.

``cost`` (the default), for one request:

1. The blocks each replica already holds (``held``): announced by its daemon
   in any tier, or promised by this gateway's requests sent there whose
   prefill has not ended (a conversation's next turn may come before that:
   queued behind its previous turn, it finds them cached), or its template.
2. The time to first token each replica would give it: the prefill work queued
   there (``ReplicaState.queued_tokens``) and this request's own uncached
   tokens, over the replica's measured prefill rate (a fixed time per forward
   plus a time per token). The request's own tokens weigh more than queued
   ones: they delay every request that will queue behind it there, in a
   steady state as many as it finds queued ahead. So the weight is the
   requests queued per replica: the fleet's queued tokens per replica over a
   request's uncached tokens (a moving mean of this gateway's requests); deep
   queues make a cache miss dear. ``work_weight`` is its floor (near idle a
   cache miss is still paid again by the turns that follow, and a queue
   drains by itself).
3. The minimum wins; ties go to the template's replica, else by rendezvous
   order on the request's first block that not every candidate holds (a
   common system prompt says nothing: the conversation's own first block
   spreads new conversations evenly, and keeps a conversation's turns together).

``affinity`` (the previous default, kept as a baseline): the template's
replica, else the longest run (ties: the first by address), else the first
block's rendezvous order; bounded by load (a target running ``load`` requests
takes one more while ``load + 1 <= factor * mean + slack``, past that the
least loaded). ``round-robin`` takes the candidates in turn.
"""

from __future__ import annotations

import itertools
import math

from gateway.placement import TemplatePlacement, rendezvous
from gateway.replica_load import ReplicaState, fleet_rate
from gateway.route_types import RouteKey, RouterConfig

#: the weight of a request sent in the moving mean of requests' uncached tokens
_WORK_EWMA = 0.01


class Policy:
    """Chooses among the candidates; ``sent`` hears of each request routed."""

    def choose(self, key: RouteKey, candidates: list[ReplicaState], held: dict[int, int]) -> ReplicaState:
        raise NotImplementedError

    def sent(self, uncached_tokens: int) -> None:
        """A request with this much prefill work was sent."""


class RoundRobinPolicy(Policy):
    def __init__(self) -> None:
        self._turn = itertools.count()

    def choose(self, key: RouteKey, candidates: list[ReplicaState], held: dict[int, int]) -> ReplicaState:
        return candidates[next(self._turn) % len(candidates)]


class AffinityPolicy(Policy):
    def __init__(self, config: RouterConfig, placement: TemplatePlacement) -> None:
        self.config = config
        self._placement = placement

    def choose(self, key: RouteKey, candidates: list[ReplicaState], held: dict[int, int]) -> ReplicaState:
        if key.template:
            target = self._placement.home(key.template, candidates)
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


class CostPolicy(Policy):
    """The least estimated time to first token (see the module's docstring)."""

    def __init__(self, config: RouterConfig, placement: TemplatePlacement) -> None:
        self.config = config
        self._placement = placement
        self._turn = itertools.count()
        self._mean_work = 0.0  # uncached tokens of a request sent, a moving mean (0: none yet)

    def sent(self, uncached_tokens: int) -> None:
        self._mean_work += (uncached_tokens - self._mean_work) * (_WORK_EWMA if self._mean_work else 1.0)

    def choose(self, key: RouteKey, candidates: list[ReplicaState], held: dict[int, int]) -> ReplicaState:
        """The least estimated time to first token: the prefill work queued
        there and this request's uncached tokens (weighted) over its rate."""
        queued_tokens = [r.queued_tokens for r in candidates]
        weight = self.work_weight(sum(queued_tokens) / len(candidates))
        fleet = None if all(r.measured for r in candidates) else fleet_rate(candidates)
        # A prefix most of the fleet holds (a common system prompt) counts as
        # held everywhere: a replica that lacks it computes it once and then
        # holds it too; counted against it, a new or emptied replica would
        # never be chosen while the others have less than that queued.
        half = len(candidates) // 2
        common = sorted(held.values(), reverse=True)[half] if len(held) > half else 0
        best, tied = math.inf, []
        for r, queued in zip(candidates, queued_tokens, strict=True):
            uncached = key.uncached(max(held.get(r.slot, 0), common))
            _, forward_s, token_s, budget = r.rate
            if fleet is not None and not r.measured:
                forward_s, token_s = fleet
            cost = -(-(queued + uncached) // budget) * forward_s + (queued + weight * uncached) * token_s
            if cost < best - 1e-9:  # equal estimates may differ in the last bits
                best, tied = cost, [r]
            elif cost <= best + 1e-9:
                tied.append(r)
        return tied[0] if len(tied) == 1 else self._break_tie(key, candidates, tied, held, common)

    def work_weight(self, queued_per_replica: float) -> float:
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

    def _break_tie(
        self,
        key: RouteKey,
        candidates: list[ReplicaState],
        tied: list[ReplicaState],
        held: dict[int, int],
        common: int,
    ) -> ReplicaState:
        if key.template:  # where it is pinned: it stays cached there
            home = self._placement.home(key.template, candidates)
            if home in tied:
                return home
        tie_key = _tie_key(key, held, len(candidates), common)
        if tie_key is None:
            return tied[next(self._turn) % len(tied)]
        first = rendezvous(tie_key, (r.address for r in tied))[0]
        return next(r for r in tied if r.address == first)


def _tie_key(key: RouteKey, held: dict[int, int], num_candidates: int, common: int = 0) -> bytes | None:
    """The request's first block that not every candidate (nor most of
    them: ``common`` blocks) holds (None: no blocks)."""
    if key.template and not key.block_hashes:
        return key.template.encode()
    if not key.block_hashes:
        return None
    everywhere = min(held.values()) if len(held) == num_candidates else 0
    return key.block_hashes[min(max(everywhere, common), len(key.block_hashes) - 1)]


def make_policy(config: RouterConfig, placement: TemplatePlacement) -> Policy:
    if config.policy == "round-robin":
        return RoundRobinPolicy()
    if config.policy == "affinity":
        return AffinityPolicy(config, placement)
    return CostPolicy(config, placement)
