"""The router's vocabulary: what a request brings, what a replica reports, what a choice is.

Plain frozen values shared by the router (``gateway.router``), its policies
(``gateway.policies``), the replica links that feed it (``gateway.replicas``)
and the simulator (``benchmarks/routing_sim.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import click

from gateway.block_index import index_keys
from kvd.common.config_fields import setting

POLICIES = ("cost", "affinity", "round-robin")

#: The ``--help`` section of the gateway's routing settings (``RouterConfig``'s and the replicas' checks).
ROUTING = "routing across replicas"


@dataclass(frozen=True, slots=True)
class Stored:
    """A replica's daemon stored these blocks in ``tier`` (0: device, 1: host, 2: disk)."""

    block_hashes: Sequence[bytes]
    tier: int = 0


@dataclass(frozen=True, slots=True)
class Removed:
    """A replica's daemon no longer holds these blocks in ``tier``."""

    block_hashes: Sequence[bytes]
    tier: int = 0


@dataclass(frozen=True, slots=True)
class Cleared:
    """A replica's daemon dropped everything (or its event stream broke)."""


#: A block event as the router takes it.
Event = Stored | Removed | Cleared


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

    @property
    def tokens(self) -> int:
        """The prompt's tokens, at least its full blocks'."""
        return max(self.num_tokens, len(self.keys) * self.block_size)

    def uncached(self, held_blocks: int) -> int:
        """The prompt tokens a replica holding ``held_blocks`` leading blocks computes
        (a fully cached prompt still computes its last token)."""
        return max(1, self.tokens - held_blocks * self.block_size)


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
    """How the gateway routes; the first four fields are ``kvd-gateway``'s routing settings.

    Attributes:
        policy: "cost", "affinity" or "round-robin".
        work_weight: the least a request's own uncached token weighs against a
            queued one (cost policy; 1: the plain TTFT estimate); it weighs more
            while the fleet's queues are long (see ``CostPolicy.work_weight``).
        load_factor: how far above the mean load an affinity target may go.
        load_slack: requests a target may take above ``load_factor * mean``.
        report_lag_s: a load report covers this gateway's requests sent at least
            this long before it arrived (the engine reports on change).
        forward_s, token_s, token_budget: the prefill rate assumed for a replica
            that has not reported one yet.
    """

    policy: str = setting(
        "--routing",
        env="KVD_ROUTING",
        type=click.Choice(POLICIES),
        default="cost",
        section=ROUTING,
        help="how a request picks a replica: cost (the least estimated time to first token, from the blocks each"
        " replica holds and the prefill work queued there), affinity (its template, else its prompt's leading"
        " blocks, bounded by load) or round-robin",
    )
    work_weight: float = setting(
        "--route-work-weight",
        env="KVD_ROUTE_WORK_WEIGHT",
        type=click.FLOAT,
        default=4.0,
        section=ROUTING,
        help="cost routing: the least the request's own uncached tokens weigh against work queued on a replica"
        " (1: the plain TTFT estimate; more keeps conversations on their replica; long queues fleet-wide raise"
        " it)",
    )
    load_factor: float = setting(
        "--route-load-factor",
        env="KVD_ROUTE_LOAD_FACTOR",
        type=click.FLOAT,
        default=1.5,
        section=ROUTING,
        help="affinity routing: a target running more than FACTOR x the mean load + SLACK requests spills to the"
        " least loaded replica",
    )
    load_slack: float = setting(
        "--route-load-slack",
        env="KVD_ROUTE_LOAD_SLACK",
        type=click.FLOAT,
        default=2.0,
        section=ROUTING,
        help="see --route-load-factor",
    )
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
