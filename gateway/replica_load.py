"""One replica as the router knows it, and the load accounting behind its estimate.

A replica's queued prefill work is what its engine last reported
(``Load.queued_tokens``) plus what this gateway sent it since: a report
covers the requests sent at least ``report_lag_s`` before it arrived, so the
tokens of those sent after (``uncovered``) are added until a report covers
them. A request stays ``pending`` until its first token (its prefill no
longer waits there) or its end.

The cost estimate's terms are kept per replica in ``rate``: (reported
queued tokens, fixed time per forward, time per token, tokens per forward).
A replica that has not measured its rate yet takes the fleet's mean
(``fleet_rate``), so a replica that never ran looks neither faster nor
slower than the ones that did.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from gateway.route_types import Load, RouterConfig

#: (reported queued tokens, forward_s, token_s, token budget)
Rate = tuple[int, float, float, int]


@dataclass(slots=True)
class ReplicaState:
    """A replica: its health, this gateway's requests there, and its load.

    Owned by the ``Router``, which touches it only under its lock.
    """

    address: str
    slot: int  # its bit in the block index
    serving: bool = False
    #: times it started serving (a restarted engine on the same address counts
    #: anew: a request it refused before may try it again)
    comebacks: int = 0
    #: when it last stopped serving (-inf: it never served)
    stopped_at: float = -math.inf
    #: the daemon cache it is attached to ("": not known yet): replicas of one
    #: cache (engines sharing a daemon) hold the same blocks and pins
    cache_id: str = ""
    in_flight: int = 0
    load: Load | None = None
    load_at: float = -math.inf  # when the last report arrived
    #: this gateway's requests not yet past their first token: ticket ->
    #: (sent at, uncached tokens, the index keys of the blocks it will store)
    pending: dict[int, tuple[float, int, tuple[bytes, ...]]] = field(default_factory=dict)
    #: of those, the tokens sent after what the last load report covers
    uncovered: int = 0
    #: the estimate's terms (see the module's docstring)
    rate: Rate = (0, 0.0, 1.0, 1)
    measured: bool = False  # whether ``rate`` is its own (else the fleet's mean stands in)

    @property
    def queued_tokens(self) -> int:
        """Prefill work queued there: as last reported, plus what this gateway sent since."""
        return self.rate[0] + self.uncovered

    def covered_before(self, lag_s: float) -> float:
        return self.load_at - lag_s

    def recount(self, lag_s: float) -> None:
        covered = self.covered_before(lag_s)
        self.uncovered = sum(tokens for sent, tokens, _ in self.pending.values() if sent > covered)

    def sent(self, ticket: int, at: float, uncached_tokens: int, new_keys: tuple[bytes, ...]) -> None:
        """Counts a request sent there."""
        self.in_flight += 1
        self.pending[ticket] = (at, uncached_tokens, new_keys)
        self.uncovered += uncached_tokens

    def drop(self, ticket: int | None, lag_s: float) -> tuple[bytes, ...]:
        """Forgets a pending request; returns the keys it promised."""
        entry = self.pending.pop(ticket, None)
        if entry is None:
            return ()
        if entry[0] > self.covered_before(lag_s):
            self.uncovered -= entry[1]
        return entry[2]

    def reported(self, load: Load | None, at: float, config: RouterConfig) -> None:
        """A load report arrived (None: the load stream broke)."""
        self.load, self.load_at = load, (at if load is not None else -math.inf)
        self.recount(config.report_lag_s)
        self.rate, self.measured = rate_terms(load, config)


def rate_terms(load: Load | None, config: RouterConfig) -> tuple[Rate, bool]:
    """The estimate's terms from a report, and whether its rate was measured."""
    if load is None:
        return (0, config.forward_s, config.token_s, config.token_budget), False
    budget = load.token_budget if load.token_budget > 0 else config.token_budget
    if load.token_s > 0:
        return (load.queued_tokens, load.forward_s, load.token_s, budget), True
    return (load.queued_tokens, config.forward_s, config.token_s, budget), False


def fleet_rate(candidates: list[ReplicaState]) -> tuple[float, float] | None:
    """The mean measured (forward_s, token_s) of the candidates, for those not measured yet."""
    measured = [r.rate for r in candidates if r.measured]
    if not measured:
        return None
    return sum(m[1] for m in measured) / len(measured), sum(m[2] for m in measured) / len(measured)
