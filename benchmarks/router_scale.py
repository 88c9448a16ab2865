"""The router at fleet scale: ``Router.choose()`` latency and the index's memory per known block.

    .venv/bin/python benchmarks/router_scale.py --json benchmarks/results/router_scale.json [--quick]

The router holds ``--replicas`` replicas, each known to hold
``--blocks-per-replica`` blocks (announced as the daemons' events would), each
block held by ``--holders`` replicas (a fleet shares blocks: system prompts,
templates, conversations that moved; 1 is the most memory, each pair its own
entry). Then it routes prompts of ``--prompt-tokens`` tokens (16-token blocks)
with the cost policy, in three cases:

- ``hit``: a shared system prompt every replica holds, then the rest held on one replica;
- ``everywhere``: every block on every replica (the longest walk: every
  replica stays in the run to the end, and they all tie);
- ``miss``: blocks no one holds.

Memory: the process's resident set before and after the index is built, over
the index's entries (distinct block hashes) and over the (replica, block) pairs.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from typing import Any

import harness

from gateway.router import Load, RouteKey, Router, RouterConfig, Stored

BLOCK = 16
CHUNK = 50_000


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def build(router: Router, addresses: list[str], blocks_per_replica: int, holders: int, rng: random.Random) -> int:
    """Announces the blocks; returns the distinct hashes announced."""
    distinct = len(addresses) * blocks_per_replica // holders
    for group, start in enumerate(range(0, distinct, CHUNK)):
        hashes = [rng.randbytes(32) for _ in range(min(CHUNK, distinct - start))]
        for j in range(holders):
            router.record_events(addresses[(group * holders + j) % len(addresses)], [Stored(hashes, 0)])
    return distinct


def timed(router: Router, key: RouteKey, rounds: int) -> dict[str, float]:
    """Wall time, and this thread's CPU time (on a shared machine, the wall
    time's tail is mostly other processes' turns on the cores)."""
    wall, cpu = [], []
    for _ in range(rounds):
        started, started_cpu = time.perf_counter_ns(), time.thread_time_ns()
        router.choose(key)
        cpu.append((time.thread_time_ns() - started_cpu) / 1000.0)
        wall.append((time.perf_counter_ns() - started) / 1000.0)
    return {"p50_us": harness.percentile(wall, 50), "p99_us": harness.percentile(wall, 99),
            "cpu_p50_us": harness.percentile(cpu, 50), "cpu_p99_us": harness.percentile(cpu, 99)}  # fmt: skip


def run(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    addresses = [f"10.1.{i // 250}.{i % 250 + 1}:50052" for i in range(args.replicas)]
    router = Router(RouterConfig(policy="cost"))
    router.set_replicas(addresses)
    for address in addresses:
        router.set_serving(address, True)
        # Unequal queues, as a loaded fleet has: the cost differs per replica.
        router.report_load(address, Load(queued_tokens=rng.randint(0, 20_000), forward_s=0.02, token_s=1e-4,
                                         token_budget=2048))  # fmt: skip
    before = rss_bytes()
    started = time.perf_counter()
    distinct = build(router, addresses, args.blocks_per_replica, args.holders, rng)
    build_s = time.perf_counter() - started
    index_bytes = rss_bytes() - before
    pairs = args.replicas * args.blocks_per_replica

    n = args.prompt_tokens // BLOCK
    system = [rng.randbytes(32) for _ in range(n // 8)]
    own = [rng.randbytes(32) for _ in range(n - len(system))]
    everywhere = [rng.randbytes(32) for _ in range(n)]
    for address in addresses:
        router.record_events(address, [Stored(system, 0), Stored(everywhere, 0)])
    router.record_events(addresses[len(addresses) // 2], [Stored(own, 0)])
    keys = {
        "hit": RouteKey(block_hashes=tuple(system + own), num_tokens=args.prompt_tokens),
        "everywhere": RouteKey(block_hashes=tuple(everywhere), num_tokens=args.prompt_tokens),
        "miss": RouteKey(block_hashes=tuple(rng.randbytes(32) for _ in range(n)), num_tokens=args.prompt_tokens),
    }
    assert router.choose(keys["hit"]) == addresses[len(addresses) // 2]
    results: dict[str, Any] = {case: timed(router, key, args.rounds) for case, key in keys.items()}
    results["index"] = {
        "entries": distinct,
        "replica_block_pairs": pairs,
        "rss_bytes": index_bytes,
        "bytes_per_entry": index_bytes / distinct,
        "bytes_per_known_block": index_bytes / pairs,
        "build_s": build_s,
    }
    return results


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = harness.parser(__doc__, quick_help="8 replicas x 100k blocks")
    p.add_argument("--replicas", type=int, help="default 64; quick 8")
    p.add_argument("--blocks-per-replica", type=int, help="default 1,000,000; quick 100,000")
    p.add_argument("--holders", type=int, default=8, help="replicas holding each block")
    p.add_argument("--prompt-tokens", type=int, default=32_768)
    p.add_argument("--rounds", type=int, default=2000)
    p.add_argument("--seed", type=int, default=5)
    args = p.parse_args(argv)
    args.replicas = args.replicas or (8 if args.quick else 64)
    args.blocks_per_replica = args.blocks_per_replica or (100_000 if args.quick else 1_000_000)
    args.holders = min(args.holders, args.replicas)
    return args


def report(args: argparse.Namespace, results: dict[str, Any]) -> dict[str, Any]:
    return {
        "benchmark": "router_scale",
        "quick": args.quick,
        "machine": harness.machine_info(),
        "source": harness.source_digest(harness.ROUTER_SOURCES),
        "workload": {k: getattr(args, k) for k in ("replicas", "blocks_per_replica", "holders", "prompt_tokens",
                                                    "rounds", "seed")} | {"block_size": BLOCK},
        "results": harness.rounded(results),
        "ratios": {"choose_cpu_p99_over_target": harness.ratio(max(r["cpu_p99_us"] for c, r in results.items()
                                                                  if c != "index"), 200.0)},
    }  # fmt: skip


def table(report: dict[str, Any]) -> str:
    results = report["results"]
    rows = [[case, r["p50_us"], r["p99_us"], r["cpu_p50_us"], r["cpu_p99_us"]]
            for case, r in results.items() if case != "index"]  # fmt: skip
    return "\n".join([
        harness.format_table(["case", "p50 us", "p99 us", "cpu p50 us", "cpu p99 us"], rows),
        f"index: {results['index']['bytes_per_entry']:.0f} bytes per entry, "
        f"{results['index']['bytes_per_known_block']:.1f} per known (replica, block)",
    ])  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    return harness.main(parse_args(argv), measure=lambda args, _folder: run(args), report=report, table=table)


if __name__ == "__main__":
    sys.exit(main())
