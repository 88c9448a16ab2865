"""Routing at scale, simulated: the real ``gateway.router.Router`` over N simulated replicas.

    .venv/bin/python benchmarks/routing_sim.py --json benchmarks/results/routing_sim.json [--quick]
        [--trace FILE.jsonl ...]

A discrete-event simulation, no processes. Each replica is an LRU cache of
``--cache-blocks`` blocks of ``--block-tokens`` tokens and a first-come
first-served prefill server: a request computes its uncached tokens in
forwards of at most ``--token-budget`` tokens, each costing ``--forward-s``
plus ``1 / --prefill-tokens-per-s`` a token, slowed by ``--decode-slowdown``
for every request decoding alongside; after its first token a request decodes
its output at ``--decode-tokens-per-s``. Its cache hit is decided when its
prefill starts (the daemon's admission); its blocks are stored when it ends,
evicting the least recently used. The router learns what the daemons would
tell it, as they would, ``--event-delay-s`` later: block stored / removed
events, and the engine's load report (queued uncached tokens, running
requests, the prefill rate) on every change. It sees a request's first token
(``prefilled``) and its end (``finished``) as the gateway does.

Policies: ``round-robin``, ``affinity`` (the previous default), ``cost`` (the
new default) and ``oracle``: the replica whose own exact time to first token,
as the simulator knows it at that instant (its queue, its cache and the
blocks the requests queued ahead will have stored when this one starts), is least.

Workloads (prompt lengths heavy-tailed, lognormal):

- ``chat``: conversations arriving at random, each a shared system prompt, a
  first user message (mean near 7k tokens) and more turns (geometric count),
  each turn's prompt the previous prompt, its answer and a new message, after
  a think time (exponential) from the previous answer's end;
- ``templates``: many tenants, each with templates pinned on one replica (the
  keeper's rendezvous choice), requests open-loop Poisson, a tenant by a Zipf
  law, then one of its templates, then text of its own;
- ``trace:FILE``: a JSONL trace, one request a line, ``{"timestamp": ms,
  "input_length": n, "output_length": n, "hash_ids": [one id a 512-token
  block, prefix-chained]}``, its timestamps scaled to the load.

Load: the offered prefill work over the fleet's prefill capacity, the work
counted as a single infinite shared cache would leave it (each block computed
once): a load of 0.9 with a policy that loses hits is more than 0.9. A trace's
timestamps are scaled so that the busiest tenth of its span has that load.
Statistics count the requests that arrive after the first ``--warmup``
fraction of the run and reach their first token.
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import itertools
import json
import math
import random
import sys
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import harness

from gateway.router import Load, Removed, RouteKey, Router, RouterConfig, Stored, rendezvous

POLICIES = ("round-robin", "affinity", "cost", "oracle")
SOURCES = (*harness.ROUTER_SOURCES, "benchmarks/routing_sim.py")


# ------------------------------------------------------------------ workload


@dataclass(slots=True)
class Request:
    blocks: tuple[int, ...]  # the prompt's full blocks' ids, prefix-chained
    tokens: int
    output: int
    template: str = ""
    template_blocks: int = 0
    #: chat: the conversation, which sends its next turn after this one ends
    follow: Iterator[tuple[float, Request]] | None = None
    arrival: float = 0.0
    replica: int = -1
    hit_tokens: int = 0
    started: float = math.nan  # prefill start
    first_token: float = math.nan
    ticket: int = 0
    expected_uncached: int = 0  # what its replica's daemon lacked when it came


@dataclass(frozen=True)
class Shape:
    block_tokens: int
    system_tokens: int = 2048
    first_message_median: float = 4500.0  # lognormal, sigma 0.9: mean near 6.8k
    message_median: float = 450.0  # later turns' messages, sigma 1.0
    output_median: float = 220.0  # sigma 0.7
    turns_mean: float = 4.0
    think_s: float = 12.0
    template_median: float = 2500.0
    suffix_median: float = 4500.0


def lognormal(rng: random.Random, median: float, sigma: float, cap: float = 60_000) -> int:
    return max(1, int(min(cap, median * math.exp(rng.gauss(0.0, sigma)))))


class Ids:
    """Block ids: one per distinct prefix (the prefix chain), as the daemons' hashes are."""

    def __init__(self) -> None:
        self._next = itertools.count(1)

    def fresh(self, n: int) -> tuple[int, ...]:
        return tuple(next(self._next) for _ in range(n))


def conversation(
    rng: random.Random, shape: Shape, system: tuple[int, ...], ids: Ids
) -> Iterator[tuple[float, Request]]:
    """A conversation's turns: (think time before it, the request)."""
    bt = shape.block_tokens
    tokens = shape.system_tokens + lognormal(rng, shape.first_message_median, 0.9)
    blocks = system + ids.fresh(tokens // bt - len(system))
    turns = 1 + int(rng.expovariate(1.0 / (shape.turns_mean - 1))) if shape.turns_mean > 1 else 1
    for turn in range(turns):
        output = lognormal(rng, shape.output_median, 0.7, cap=4000)
        yield (0.0 if turn == 0 else rng.expovariate(1.0 / shape.think_s)), Request(blocks, tokens, output)
        tokens += output + lognormal(rng, shape.message_median, 1.0)
        blocks = blocks + ids.fresh(tokens // bt - len(blocks))


@dataclass
class Workload:
    name: str
    #: (arrival time, request) of the open-loop arrivals; chat turns follow their conversation
    arrivals: list[tuple[float, Request]]
    #: template -> its blocks (pinned on one replica)
    templates: dict[str, tuple[int, ...]] = field(default_factory=dict)
    duration_s: float = 0.0


def ideal_work(requests: list[Request], block_tokens: int) -> float:
    """Prompt tokens to compute with one infinite shared cache."""
    seen: set[int] = set()
    work = 0
    for r in requests:
        new = [b for b in r.blocks if b not in seen]
        seen.update(new)
        work += max(1, r.tokens - (len(r.blocks) - len(new)) * block_tokens)
    return work


def chat_workload(
    rng: random.Random, shape: Shape, capacity_tokens_per_s: float, load: float, duration_s: float
) -> Workload:
    ids = Ids()
    system = ids.fresh(shape.system_tokens // shape.block_tokens)
    # Offered work per conversation, measured on a sample of the same law.
    sample_ids = Ids()
    sample_system = sample_ids.fresh(len(system))
    sample_rng = random.Random(rng.random())
    sample = [r for _ in range(500) for _, r in conversation(sample_rng, shape, sample_system, sample_ids)]
    per_conversation = (ideal_work(sample, shape.block_tokens) - shape.system_tokens) / 500
    rate = load * capacity_tokens_per_s / per_conversation
    arrivals, t = [], 0.0
    while (t := t + rng.expovariate(rate)) < duration_s:
        turns = conversation(random.Random(rng.random()), shape, system, ids)
        _, first = next(turns)
        first.follow = turns
        arrivals.append((t, first))
    return Workload("chat", arrivals, duration_s=duration_s)


def template_workload(
    rng: random.Random, shape: Shape, capacity_tokens_per_s: float, load: float, duration_s: float, tenants: int
) -> Workload:
    ids = Ids()
    bt = shape.block_tokens
    templates: dict[str, tuple[int, ...]] = {}
    by_tenant: list[list[tuple[str, int]]] = []
    for tenant in range(tenants):
        own = []
        for i in range(rng.randint(1, 3)):
            tokens = lognormal(rng, shape.template_median, 0.8, cap=16_000)
            name = f"tenant{tenant}/t{i}"
            templates[name] = ids.fresh(tokens // bt)
            own.append((name, tokens))
        by_tenant.append(own)
    weights = [1.0 / (k + 1) for k in range(tenants)]  # Zipf, s = 1
    mean_suffix = shape.suffix_median * math.exp(0.9**2 / 2)
    # A request also computes its template's partial last block (not pinned):
    # left out, the offered work was 4% over the load asked for.
    partial = sum(w * sum(t % bt for _, t in own) / len(own) for w, own in zip(weights, by_tenant, strict=True))
    rate = load * capacity_tokens_per_s / (mean_suffix + partial / sum(weights))
    arrivals, t = [], 0.0
    while (t := t + rng.expovariate(rate)) < duration_s:
        name, template_tokens = rng.choice(rng.choices(by_tenant, weights)[0])
        tokens = template_tokens + lognormal(rng, shape.suffix_median, 0.9)
        pinned = templates[name]
        # The template's partial last block, if any, is part of the request's own first block.
        blocks = pinned + ids.fresh(tokens // bt - len(pinned))
        output = lognormal(rng, shape.output_median, 0.7, cap=4000)
        arrivals.append((t, Request(blocks, tokens, output, name, len(pinned))))
    return Workload("templates", arrivals, templates, duration_s)


def trace_workload(path: Path, block_tokens: int, capacity_tokens_per_s: float, load: float) -> Workload:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows.sort(key=lambda row: row["timestamp"])
    requests = []
    for row in rows:
        full = int(row["input_length"]) // block_tokens
        blocks = tuple(int(h) for h in row["hash_ids"][:full])
        requests.append(Request(blocks, int(row["input_length"]), max(1, int(row["output_length"]))))
    # The load is the busiest tenth of the trace's span (by its prefill work):
    # averaged over the whole span, a trace's ramps would leave its peak far
    # busier than asked (and an open-loop overload never recovers).
    t0, span_ms = rows[0]["timestamp"], max(1, rows[-1]["timestamp"] - rows[0]["timestamp"])
    seen: set[int] = set()
    work_by_tenth = [0.0] * 10
    for row, r in zip(rows, requests, strict=True):
        new = [b for b in r.blocks if b not in seen]
        seen.update(new)
        tenth = min(9, (row["timestamp"] - t0) * 10 // span_ms)
        work_by_tenth[tenth] += max(1, r.tokens - (len(r.blocks) - len(new)) * block_tokens)
    scale = max(work_by_tenth) / (load * capacity_tokens_per_s) / (span_ms / 10_000.0)
    arrivals = [((row["timestamp"] - t0) / 1000.0 * scale, r) for row, r in zip(rows, requests, strict=True)]
    wanted_s = arrivals[-1][0]
    return Workload(f"trace:{path.name}", arrivals, duration_s=wanted_s)


# ------------------------------------------------------------------ replicas


@dataclass(frozen=True)
class ServerShape:
    cache_blocks: int
    block_tokens: int
    prefill_tokens_per_s: float
    forward_s: float
    token_budget: int
    decode_tokens_per_s: float
    decode_slowdown: float


class Replica:
    """An LRU block cache and a first-come first-served prefill server."""

    def __init__(self, index: int, shape: ServerShape) -> None:
        self.index = index
        self.address = f"10.0.{index // 250}.{index % 250 + 1}:50052"
        self.shape = shape
        self.cache: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self.pinned: set[int] = set()
        #: block -> the requests queued or prefilling here that store it when they end
        self.coming: dict[int, int] = {}
        self.queue: deque[Request] = deque()
        self.current: Request | None = None
        self.current_end = 0.0
        self.decoding = 0
        self.busy_s = 0.0
        self.backlog_end = 0.0  # the oracle's view: when its queued prefills end

    def slowdown(self) -> float:
        return 1.0 + self.shape.decode_slowdown * self.decoding

    def held_run(self, blocks: tuple[int, ...], coming: bool = False) -> int:
        """The leading blocks held now (``coming``: or stored by the requests
        ahead in the queue, as they will be when a request sent now starts)."""
        run = 0
        for b in blocks:
            if b not in self.cache and b not in self.pinned and not (coming and b in self.coming):
                break
            run += 1
        return run

    def expect(self, blocks: tuple[int, ...], sign: int) -> None:
        """Counts a queued request's blocks in (1) or out (-1) of ``coming``."""
        for b in blocks:
            n = self.coming.get(b, 0) + sign
            if n:
                self.coming[b] = n
            else:
                del self.coming[b]

    def prefill_s(self, uncached: int) -> float:
        s = self.shape
        forwards = math.ceil(uncached / s.token_budget)
        return (forwards * s.forward_s + uncached / s.prefill_tokens_per_s) * self.slowdown()

    def uncached(self, request: Request, coming: bool = False) -> int:
        """The prompt tokens to compute: as the daemon sees it now, or (``coming``)
        when the request's prefill would start if sent now (the oracle's view)."""
        return max(1, request.tokens - self.held_run(request.blocks, coming) * self.shape.block_tokens)

    def touch(self, blocks: tuple[int, ...]) -> None:
        for b in blocks:
            if b in self.cache:
                self.cache.move_to_end(b)

    def store(self, blocks: tuple[int, ...]) -> tuple[list[int], list[int]]:
        """Adds ``blocks`` (most recent); returns (stored, evicted)."""
        stored = [b for b in blocks if b not in self.cache and b not in self.pinned]
        for b in blocks:
            if b not in self.pinned:
                self.cache[b] = None
                self.cache.move_to_end(b)
        evicted = []
        while len(self.cache) > self.shape.cache_blocks - len(self.pinned):
            b, _ = self.cache.popitem(last=False)
            evicted.append(b)
        return stored, evicted

    def queued_tokens(self, now: float) -> int:
        """Prompt tokens still to compute, as its engine reports them: of each
        waiting request what the daemon did not hold when it came (the engine
        asks it), the uncached rest of the one prefilling."""
        queued = self.waiting_tokens
        if self.current is not None:
            done = (now - self.current.started) / max(1e-9, self.current_end - self.current.started)
            queued += int(self.uncached_at_start * max(0.0, 1.0 - done))
        return queued

    uncached_at_start = 0
    waiting_tokens = 0  # the uncached tokens of ``queue``'s requests when they came


# ----------------------------------------------------------------- simulator


def block_key(block: int) -> bytes:
    return block.to_bytes(8, "little") + b"\0" * 24


class Simulation:
    def __init__(
        self, workload: Workload, replicas: int, shape: ServerShape, policy: str, config: dict[str, Any],
        event_delay_s: float, seed: int,
    ) -> None:  # fmt: skip
        self.now = 0.0
        self.events: list[tuple[float, int, Callable[..., None], tuple]] = []
        self._seq = itertools.count()
        self.workload = workload
        self.shape = shape
        self.policy = policy
        self.delay = event_delay_s
        self.replicas = [Replica(i, shape) for i in range(replicas)]
        self.by_address = {r.address: r for r in self.replicas}
        routed_by = policy if policy != "oracle" else "cost"  # the oracle only uses its bookkeeping
        self.router = Router(RouterConfig(policy=routed_by, **config), clock=lambda: self.now)
        self.router.set_replicas(self.by_address)
        for r in self.replicas:
            self.router.set_serving(r.address, True)
        self.done: list[Request] = []
        self.rng = random.Random(seed)
        self._place_templates()

    def at(self, t: float, fn: Callable[..., None], *args: Any) -> None:
        heapq.heappush(self.events, (t, next(self._seq), fn, args))

    def run(self) -> None:
        for t, request in self.workload.arrivals:
            self.at(t, self.arrive, request)
        while self.events:
            self.now, _, fn, args = heapq.heappop(self.events)
            fn(*args)

    # -------------------------------------------------------------- templates

    def _place_templates(self) -> None:
        addresses = list(self.by_address)
        for name, blocks in self.workload.templates.items():
            home = self.by_address[rendezvous(name.encode(), addresses)[0]]
            home.pinned.update(blocks)
            self.router.place(name, home.address)
            self.router.record_events(home.address, [Stored([block_key(b) for b in blocks], 0)])

    # ----------------------------------------------------------------- events

    def arrive(self, request: Request) -> None:
        request.arrival = self.now
        replica, new_keys = self._choose(request)
        request.replica = replica.index
        request.ticket = self.router.started(replica.address, replica.uncached(request), new_keys)
        replica.backlog_end = max(self.now, replica.backlog_end) + replica.prefill_s(replica.uncached(request, True))
        replica.expect(request.blocks, 1)
        request.expected_uncached = replica.uncached(request)
        replica.queue.append(request)
        replica.waiting_tokens += request.expected_uncached
        if replica.current is None:
            self._start_next(replica)
        self._report(replica)

    def _choose(self, request: Request) -> tuple[Replica, tuple[bytes, ...]]:
        """The replica, and the blocks the router expects the request to store there."""
        if self.policy == "oracle":
            best = min(
                self.replicas,
                key=lambda r: (max(self.now, r.backlog_end) + r.prefill_s(r.uncached(request, True)), r.index),
            )
            return best, ()
        key = RouteKey(
            request.template,
            tuple(block_key(b) for b in request.blocks),
            request.tokens,
            self.shape.block_tokens,
            request.template_blocks,
        )
        route = self.router.route(key)
        return self.by_address[route.address], route.new_keys

    def _start_next(self, replica: Replica) -> None:
        if not replica.queue:
            replica.current = None
            return
        request = replica.queue.popleft()
        replica.waiting_tokens -= request.expected_uncached
        run = replica.held_run(request.blocks)
        replica.touch(request.blocks[:run])
        uncached = max(1, request.tokens - run * self.shape.block_tokens)
        request.hit_tokens = request.tokens - uncached
        request.started = self.now
        replica.current, replica.uncached_at_start = request, uncached
        service = replica.prefill_s(uncached)
        replica.current_end = self.now + service
        replica.busy_s += service
        self.at(replica.current_end, self.prefilled, replica, request)

    def prefilled(self, replica: Replica, request: Request) -> None:
        request.first_token = self.now
        stored, evicted = replica.store(request.blocks)
        replica.expect(request.blocks, -1)
        events = []
        if stored:
            events.append(Stored([block_key(b) for b in stored], 0))
        if evicted:
            events.append(Removed([block_key(b) for b in evicted], 0))
        if events:
            self.at(self.now + self.delay, self.router.record_events, replica.address, events)
        self.at(self.now + self.delay, self.router.prefilled, replica.address, request.ticket)
        replica.decoding += 1
        self.at(self.now + request.output / self.shape.decode_tokens_per_s, self.decoded, replica, request)
        self._start_next(replica)
        self._report(replica)

    def decoded(self, replica: Replica, request: Request) -> None:
        replica.decoding -= 1
        self.done.append(request)
        self.at(self.now + self.delay, self.router.finished, replica.address, request.ticket)
        if request.follow is not None:
            nxt = next(request.follow, None)
            if nxt is not None:
                think, following = nxt
                following.follow = request.follow
                if self.now + think < self.workload.duration_s:
                    self.at(self.now + think, self.arrive, following)
        self._report(replica)

    def _report(self, replica: Replica) -> None:
        slow = replica.slowdown()
        s = self.shape
        load = Load(
            queued_tokens=replica.queued_tokens(self.now),
            running=replica.decoding + (replica.current is not None),
            free_blocks=max(0, s.cache_blocks - len(replica.cache) - len(replica.pinned)),
            forward_s=s.forward_s * slow,
            token_s=slow / s.prefill_tokens_per_s,
            token_budget=s.token_budget,
        )
        self.at(self.now + self.delay, self.router.report_load, replica.address, load)

    # ------------------------------------------------------------------ stats

    def stats(self, warmup: float) -> dict[str, Any]:
        since = warmup * self.workload.duration_s
        counted = [r for r in self.done if r.arrival >= since]
        ttft = [r.first_token - r.arrival for r in counted]
        prompt = sum(r.tokens for r in counted)
        span = max(1e-9, self.now)
        utilisation = [r.busy_s / span for r in self.replicas]
        return {
            "requests": len(counted),
            "hit_rate": sum(r.hit_tokens for r in counted) / prompt if prompt else math.nan,
            "ttft_mean_s": harness.mean(ttft),
            "ttft_p50_s": harness.percentile(ttft, 50),
            "ttft_p90_s": harness.percentile(ttft, 90),
            "utilisation_mean": harness.mean(utilisation),
            "utilisation_min": min(utilisation),
            "utilisation_max": max(utilisation),
            "utilisation": [round(u, 3) for u in utilisation],
            "prompt_tokens_mean": prompt / len(counted) if counted else math.nan,
        }


# ------------------------------------------------------------------------ run


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = harness.parser(__doc__, quick_help="4 replicas, one load, short runs (seconds)")
    p.add_argument("--replicas", help="comma-separated (default 8,16,64; quick 4)")
    p.add_argument("--loads", help="comma-separated (default 0.7,0.9; quick 0.8)")
    p.add_argument("--workloads", default="chat,templates", help="chat, templates (and each --trace)")
    p.add_argument("--trace", action="append", default=[], help="a JSONL trace (repeatable)")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--duration-s", type=float, help="simulated seconds of arrivals (default 400; quick 60)")
    p.add_argument("--warmup", type=float, default=0.25, help="the leading fraction of the run not counted")
    p.add_argument("--block-tokens", type=int, default=512)
    p.add_argument("--cache-blocks", type=int, default=2048, help="blocks per replica")
    p.add_argument("--prefill-tokens-per-s", type=float, default=8000.0)
    p.add_argument("--forward-s", type=float, default=0.015, help="fixed time of a forward")
    p.add_argument("--token-budget", type=int, default=4096, help="tokens per forward")
    p.add_argument("--decode-tokens-per-s", type=float, default=40.0, help="per request")
    p.add_argument("--decode-slowdown", type=float, default=0.004, help="prefill slowdown per decoding request")
    p.add_argument("--event-delay-s", type=float, default=0.005, help="daemon events and load reports arrive late")
    p.add_argument("--tenants-per-replica", type=float, default=4.0)
    p.add_argument("--work-weight", type=float, default=RouterConfig.work_weight)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--write-trace", metavar="FILE",
                   help="write a chat trace (open loop, in the JSONL form) of --duration-s at load 1 on 8 replicas"
                   " and exit")  # fmt: skip
    args = p.parse_args(argv)
    args.replicas = [int(x) for x in (args.replicas or ("4" if args.quick else "8,16,64")).split(",")]
    args.loads = [float(x) for x in (args.loads or ("0.8" if args.quick else "0.7,0.9")).split(",")]
    args.duration_s = args.duration_s or (60.0 if args.quick else 400.0)
    args.workloads = [w for w in args.workloads.split(",") if w] + [f"trace:{t}" for t in args.trace]
    args.policies = [x for x in args.policies.split(",") if x]
    for policy in args.policies:
        if policy not in POLICIES:
            p.error(f"--policies: unknown policy {policy!r} (known: {', '.join(POLICIES)})")
    return args


def build_workload(name: str, args: argparse.Namespace, replicas: int, load: float, seed: int) -> Workload:
    rng = random.Random(seed)
    shape = Shape(args.block_tokens)
    capacity = replicas * args.prefill_tokens_per_s
    if name == "chat":
        return chat_workload(rng, shape, capacity, load, args.duration_s)
    if name == "templates":
        tenants = max(2, int(args.tenants_per_replica * replicas))
        return template_workload(rng, shape, capacity, load, args.duration_s, tenants)
    if name.startswith("trace:"):
        return trace_workload(Path(name[len("trace:") :]), args.block_tokens, capacity, load)
    raise SystemExit(f"--workloads: unknown workload {name!r}")


def simulate(args: argparse.Namespace) -> dict[str, Any]:
    shape = ServerShape(
        args.cache_blocks, args.block_tokens, args.prefill_tokens_per_s, args.forward_s, args.token_budget,
        args.decode_tokens_per_s, args.decode_slowdown,
    )  # fmt: skip
    config = {"work_weight": args.work_weight, "report_lag_s": 2 * args.event_delay_s,
              "forward_s": args.forward_s, "token_s": 1.0 / args.prefill_tokens_per_s,
              "token_budget": args.token_budget}  # fmt: skip
    results: dict[str, Any] = {}
    cells = [(w, n, load) for w in args.workloads for n in args.replicas for load in args.loads]
    for i, (workload_name, n, load) in enumerate(cells):
        shown = f"trace:{Path(workload_name[6:]).name}" if workload_name.startswith("trace:") else workload_name
        cell = f"{shown}/{n}/{load}"
        results[cell] = {}
        for policy in args.policies:
            # The same arrivals for every policy (a fresh copy: requests carry their outcome).
            workload = build_workload(workload_name, args, n, load, args.seed)
            started = time.perf_counter()
            sim = Simulation(workload, n, shape, policy, config, args.event_delay_s, args.seed)
            sim.run()
            stats = sim.stats(args.warmup)
            stats["wall_s"] = time.perf_counter() - started
            results[cell][policy] = stats
        harness.log(f"[{i + 1}/{len(cells)}] {cell}: " + ", ".join(
            f"{p} hit {s['hit_rate']:.3f} ttft {s['ttft_mean_s']:.2f}s" for p, s in results[cell].items()))  # fmt: skip
    return results


def ratios(results: dict[str, Any]) -> dict[str, Any]:
    """Per cell: cost over oracle (mean, p90 TTFT), cost over the best hit rate, cost over round-robin."""
    out: dict[str, Any] = {}
    for cell, by_policy in results.items():
        cost = by_policy.get("cost")
        if cost is None:
            continue
        r: dict[str, Any] = {}
        if "oracle" in by_policy:
            r["cost_over_oracle_ttft_mean"] = harness.ratio(cost["ttft_mean_s"], by_policy["oracle"]["ttft_mean_s"])
            r["cost_over_oracle_ttft_p90"] = harness.ratio(cost["ttft_p90_s"], by_policy["oracle"]["ttft_p90_s"])
        r["cost_over_best_hit_rate"] = harness.ratio(cost["hit_rate"], max(s["hit_rate"] for s in by_policy.values()))
        if "round-robin" in by_policy:
            rr = by_policy["round-robin"]["ttft_mean_s"]
            r["cost_over_round_robin_ttft_mean"] = harness.ratio(cost["ttft_mean_s"], rr)
            if "oracle" in by_policy:  # whether 0.5x round-robin is within even the oracle's reach
                r["oracle_over_round_robin_ttft_mean"] = harness.ratio(by_policy["oracle"]["ttft_mean_s"], rr)
        out[cell] = r
    cells = list(out.values())
    worst = {
        "worst_ttft_over_oracle": [c.get(k) for c in cells for k in ("cost_over_oracle_ttft_mean",
                                                                       "cost_over_oracle_ttft_p90")],
        "worst_hit_over_best": [c["cost_over_best_hit_rate"] for c in cells],
        "worst_ttft_over_round_robin": [c.get("cost_over_round_robin_ttft_mean") for c in cells],
    }  # fmt: skip
    for name, values in worst.items():
        known = [v for v in values if v is not None and not math.isnan(v)]
        if known:
            out[name] = min(known) if name == "worst_hit_over_best" else max(known)
    return out


def write_trace(args: argparse.Namespace) -> None:
    """A chat workload as a trace: each turn at the time it would come with no
    queueing (the previous answer's decode and the think time after it)."""
    rng = random.Random(args.seed)
    shape = Shape(args.block_tokens)
    workload = chat_workload(rng, shape, 8 * args.prefill_tokens_per_s, 1.0, args.duration_s)
    rows = []
    for start, first in workload.arrivals:
        t, request = start, first
        while True:
            ids = list(request.blocks) + ([request.blocks[-1] + 10**9] if request.tokens % args.block_tokens else [])
            rows.append({"timestamp": int(t * 1000), "input_length": request.tokens,
                         "output_length": request.output, "hash_ids": ids})  # fmt: skip
            nxt = next(first.follow, None) if first.follow is not None else None
            if nxt is None:
                break
            think, request = nxt
            t += rows[-1]["output_length"] / args.decode_tokens_per_s + think
    rows.sort(key=lambda row: row["timestamp"])
    Path(args.write_trace).write_text("".join(json.dumps(row) + "\n" for row in rows))
    harness.log(f"wrote {len(rows)} requests to {args.write_trace}")


def report(args: argparse.Namespace, results: dict[str, Any]) -> dict[str, Any]:
    workload = {
        k: getattr(args, k)
        for k in ("replicas", "loads", "workloads", "policies", "duration_s", "warmup", "block_tokens", "cache_blocks",
                  "prefill_tokens_per_s", "forward_s", "token_budget", "decode_tokens_per_s", "decode_slowdown",
                  "event_delay_s", "tenants_per_replica", "work_weight", "seed")
    }  # fmt: skip
    workload["shape"] = dataclasses.asdict(Shape(args.block_tokens))
    return {
        "benchmark": "routing_sim",
        "quick": args.quick,
        "machine": harness.machine_info(),
        "source": harness.source_digest(SOURCES),
        "workload": workload,
        "results": harness.rounded(results),
        "ratios": harness.rounded(ratios(results)),
    }


def table(report: dict[str, Any]) -> str:
    rows = [
        [cell, policy, s["requests"], s["hit_rate"], s["ttft_mean_s"], s["ttft_p50_s"], s["ttft_p90_s"],
         s["utilisation_min"], s["utilisation_max"]]
        for cell, by_policy in report["results"].items() for policy, s in by_policy.items()
    ]  # fmt: skip
    headers = ["cell", "policy", "requests", "hit", "ttft mean s", "p50 s", "p90 s", "util min", "util max"]
    keys = ("cost_over_oracle_ttft_mean", "cost_over_oracle_ttft_p90", "cost_over_best_hit_rate",
            "cost_over_round_robin_ttft_mean", "oracle_over_round_robin_ttft_mean")  # fmt: skip
    by_cell = [[cell, *(r.get(k) for k in keys)] for cell, r in report["ratios"].items() if isinstance(r, dict)]
    return "\n".join([
        harness.format_table(headers, rows),
        harness.format_table(["cell", "cost/oracle mean", "p90", "hit/best", "cost/rr", "oracle/rr"], by_cell),
    ])  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.write_trace:
        write_trace(args)
        return 0
    return harness.main(args, measure=lambda args, _folder: simulate(args), report=report, table=table)


if __name__ == "__main__":
    sys.exit(main())
