"""Block-pool benchmark: how fast kvd admits, commits and frees requests.

Three seeded workloads (block size 16, 8 requests in flight):

    cold   every prompt is 2048 random tokens: no reuse;
    hot    one shared 1536-token prefix + 512 unique tokens (~75% token hits);
    evict  one of 32 Zipf(s=1.0) 1024-token prefixes + 1024 unique tokens in a
           pool of 4096 blocks: constant eviction.

Each runs three ways, interleaved repeat by repeat (the machine is noisy):

    kvd_inprocess        KVCacheManager calls, each operation timed;
    kvd_inprocess_step   run_step with one StepRequest per request (what the
                         daemon does per Step, without gRPC);
    kvd_rpc              one Step RPC per request to a kvd subprocess.

Request i is one step: commit request i-1's whole prompt, free request i-8,
admit request i (whole prompt, one chunk), so 8 requests hold blocks between
steps. ``step_rpc_64`` then times decode Steps of 64 running requests (64
commits of one sampled token; the daemon schedules the next token of each).

    .venv/bin/python benchmarks/block_pool.py --json FILE [--quick] [--plot FILE]
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import _common as common

from kvd.block_pool import BlockPool
from kvd.cache_manager import KVCacheManager
from kvd.client import DaemonClient
from kvd.scheduler import run_step
from kvd.session import Session
from kvd_api.daemon.v1 import daemon_pb2 as pb

BLOCK_SIZE = 16
IN_FLIGHT = 8
VOCAB = 50_000
TOKEN_BUDGET = 4096
#: cold and hot: room for every block of the full workloads (1000 x 128 cold), so nothing is evicted.
NO_EVICT_BLOCKS = 131_072
EVICT_BLOCKS = 4096
LAYOUT_FLAGS = ["--num-layers", "1", "--num-kv-heads", "1", "--head-dim", "8"]
VARIANTS = ("kvd_inprocess", "kvd_inprocess_step", "kvd_rpc")
REFERENCE = {
    "note": "quoted from the issue as context; NOT measured by this script",
    "statement": (
        "vLLM's V1 KVCacheManager was measured on this machine kind at about 1,000 requests/s "
        "cold and hot and 1,270 evict"
    ),
    "vllm_v1_kvcachemanager_requests_per_s": {"cold": 1000, "hot": 1000, "evict": 1270},
}


# ---------------------------------------------------------------- workloads


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    num_blocks: int
    params: dict[str, Any]


def random_tokens(rng: random.Random, n: int) -> list[int]:
    return rng.choices(range(VOCAB), k=n)


def build_workload(name: str, num_requests: int, seed: int) -> Workload:
    rng_seed = f"block_pool/{name}/{seed}"
    rng = random.Random(rng_seed)
    params: dict[str, Any] = {"requests": num_requests, "rng_seed": rng_seed}
    if name == "cold":
        prompts = [random_tokens(rng, 2048) for _ in range(num_requests)]
        params.update(prompt_tokens=2048, num_blocks=NO_EVICT_BLOCKS)
        return Workload(name, prompts, NO_EVICT_BLOCKS, params)
    if name == "hot":
        prefix = random_tokens(rng, 1536)
        prompts = [prefix + random_tokens(rng, 512) for _ in range(num_requests)]
        params.update(shared_prefix_tokens=1536, unique_tokens=512, num_blocks=NO_EVICT_BLOCKS)
        return Workload(name, prompts, NO_EVICT_BLOCKS, params)
    assert name == "evict", name
    num_prefixes, zipf_s = 32, 1.0
    prefixes = [random_tokens(rng, 1024) for _ in range(num_prefixes)]
    weights = [1.0 / (k + 1) ** zipf_s for k in range(num_prefixes)]
    picks = rng.choices(range(num_prefixes), weights=weights, k=num_requests)
    prompts = [prefixes[k] + random_tokens(rng, 1024) for k in picks]
    params.update(prefixes=num_prefixes, zipf_s=zipf_s, prefix_tokens=1024, unique_tokens=1024, num_blocks=EVICT_BLOCKS)
    return Workload(name, prompts, EVICT_BLOCKS, params)


def schedule(n: int) -> Iterator[tuple[int | None, list[int], int | None]]:
    """Per step: (request to commit, requests to free, request to admit); n + 1 steps."""
    for i in range(n + 1):
        commit = i - 1 if i >= 1 else None
        if i == n:  # the last step frees whoever is left
            yield commit, list(range(max(0, n - IN_FLIGHT), n)), None
        else:
            yield commit, ([i - IN_FLIGHT] if i >= IN_FLIGHT else []), i


# ------------------------------------------------------------------- runs


@dataclass
class Run:
    """One pass over a workload by one variant."""

    wall_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    new_blocks: int = 0
    evictions: int = 0
    op_us: dict[str, list[float]] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)


def run_manager(w: Workload, label: str) -> Run:
    """KVCacheManager calls: hash (new_request), admit, commit, free, each timed."""
    manager = KVCacheManager(BlockPool(w.num_blocks), BLOCK_SIZE)
    n = len(w.prompts)
    run = Run(op_us={op: [] for op in ("hash", "admit", "commit", "free")})
    t_hash, t_admit, t_commit, t_free = (run.op_us[op] for op in ("hash", "admit", "commit", "free"))
    requests: list[Any] = [None] * n
    clock = time.perf_counter_ns
    progress = common.Progress(label, n)
    start = clock()
    for commit, frees, admit in schedule(n):
        if commit is not None:
            t0 = clock()
            manager.commit(requests[commit], len(w.prompts[commit]))
            t_commit.append((clock() - t0) / 1e3)
        for index in frees:
            t0 = clock()
            manager.free(requests[index])
            t_free.append((clock() - t0) / 1e3)
            requests[index] = None  # as the daemon forgets it: no dead requests for the collector to scan
        if admit is not None:
            t0 = clock()
            request = manager.new_request(f"r{admit}", w.prompts[admit])
            t1 = clock()
            admitted = manager.admit(request, TOKEN_BUDGET)
            t2 = clock()
            t_hash.append((t1 - t0) / 1e3)
            t_admit.append((t2 - t1) / 1e3)
            if admitted is None:
                raise RuntimeError(f"{w.name}: request {admit} did not fit in {w.num_blocks} blocks")
            requests[admit] = request
            run.cached_tokens += admitted.num_cached_tokens
            run.new_blocks += len(admitted.blocks) - admitted.num_cached_tokens // BLOCK_SIZE
            if admit % 64 == 0:
                progress.advance(64)
    run.wall_s = (clock() - start) / 1e9
    progress.done()
    run.prompt_tokens = sum(map(len, w.prompts))
    run.evictions = manager.pool.num_evictions
    assert manager.pool.num_free == w.num_blocks, "blocks leaked"
    return run


def run_steps_inprocess(w: Workload, label: str) -> Run:
    """run_step with one StepRequest per request: the daemon's work per Step, minus gRPC."""
    manager = KVCacheManager(BlockPool(w.num_blocks), BLOCK_SIZE)
    session = Session(session_id="bench", client_name="block_pool", last_seen=0.0)
    return _drive_steps(w, label, lambda step: run_step(manager, session, step), lambda: manager.pool.num_evictions)


def _drive_steps(
    w: Workload, label: str, step_fn: Callable[[pb.StepRequest], pb.StepResponse], evictions: Callable[[], int]
) -> Run:
    n = len(w.prompts)
    run = Run(op_us={"step": []})
    t_step = run.op_us["step"]
    clock = time.perf_counter_ns
    progress = common.Progress(label, n)
    settings = pb.SessionSettings(max_num_seqs=64, token_budget=TOKEN_BUDGET)
    start = clock()
    for commit, frees, admit in schedule(n):
        step = pb.StepRequest(finished=[f"r{i}" for i in frees], settings=settings)
        if commit is not None:
            step.commits.request_ids.append(f"r{commit}")
            step.commits.num_computed_tokens.append(len(w.prompts[commit]))
            step.commits.num_new_tokens.append(0)
        if admit is not None:  # a warm-up: its prompt only (max_new_tokens 0)
            step.new_requests.add(request_id=f"r{admit}", prompt_token_ids=w.prompts[admit])
        t0 = clock()
        out = step_fn(step)
        if admit is None:
            continue
        t_step.append((clock() - t0) / 1e3)
        _account(run, w, admit, out)
        if admit % 64 == 0:
            progress.advance(64)
    run.wall_s = (clock() - start) / 1e9
    progress.done()
    run.prompt_tokens = sum(map(len, w.prompts))
    run.evictions = evictions()
    return run


def _account(run: Run, w: Workload, admit: int, out: pb.StepResponse) -> None:
    s = out.scheduled
    if out.num_waiting or out.preempted or list(s.request_ids) != [f"r{admit}"]:
        raise RuntimeError(f"{w.name}: request {admit} was not admitted ({out.num_waiting} waiting)")
    cached = s.num_cached_tokens[0]
    run.cached_tokens += cached
    run.new_blocks += s.num_new_blocks[0] - cached // BLOCK_SIZE


def run_rpc(client: DaemonClient, w: Workload, label: str) -> Run:
    """One Step RPC per request through the client's session."""
    session = client.attach("block_pool-bench", map_memory=False)
    before = client.stats()
    run = _drive_steps(w, label, session.step, lambda: 0)
    after = client.stats()
    session.detach()
    client.stub.Reset(pb.ResetRequest())  # the next repeat starts with an empty cache
    run.evictions = after.evictions - before.evictions
    query = after.query_tokens - before.query_tokens
    run.extra["stats_token_hit_rate"] = (after.hit_tokens - before.hit_tokens) / query if query else 0.0
    return run


def summarize(runs: list[Run], requests: int) -> dict[str, Any]:
    """Medians over repeats; counts come from the first repeat (they are deterministic)."""
    first = runs[0]
    out: dict[str, Any] = {
        "requests_per_s": common.median([requests / r.wall_s for r in runs]),
        "new_blocks_per_s": common.median([r.new_blocks / r.wall_s for r in runs]),
        "token_hit_rate": first.cached_tokens / first.prompt_tokens,
        "evictions": first.evictions,
        "us_per_request": {op: common.median([common.median(r.op_us[op]) for r in runs]) for op in first.op_us},
        "us_per_request_mean": {op: common.median([common.mean(r.op_us[op]) for r in runs]) for op in first.op_us},
        "wall_s": common.median([r.wall_s for r in runs]),
        "requests": requests,
        "new_blocks": first.new_blocks,
        "repeats": len(runs),
        "deterministic": all(
            (r.cached_tokens, r.new_blocks, r.evictions) == (first.cached_tokens, first.new_blocks, first.evictions)
            for r in runs
        ),
    }
    for key in first.extra:
        out[key] = common.median([r.extra[key] for r in runs])
    return out


# ------------------------------------------------------------------ decode


def decode_steps(
    step_fn: Callable[[pb.StepRequest], pb.StepResponse],
    running: int,
    prompt_len: int,
    steps: int,
    warmup: int,
    seed: int,
) -> list[float]:
    """Admits ``running`` prompts, then times decode steps; returns ms per timed step.

    Each decode step commits every request's last sampled token
    (``num_computed_tokens`` + 1, one new token id); the daemon schedules the
    next token of each: what an engine sends and gets per step.
    """
    rng = random.Random(f"block_pool/decode/{seed}")
    ids = [f"d{k}" for k in range(running)]
    prompts = [random_tokens(rng, prompt_len) for _ in ids]
    first = pb.StepRequest(settings=pb.SessionSettings(max_num_seqs=running, token_budget=running * prompt_len))
    for r, p in zip(ids, prompts, strict=True):
        first.new_requests.add(request_id=r, prompt_token_ids=p, max_new_tokens=warmup + steps + 2)
    if len(step_fn(first).scheduled.request_ids) != running:
        raise RuntimeError("decode: not every request was admitted")
    times_ms = []
    for s in range(warmup + steps):
        computed = prompt_len + s
        step = pb.StepRequest()
        c = step.commits
        c.request_ids.extend(ids)
        c.num_computed_tokens.extend([computed] * running)
        c.num_new_tokens.extend([1] * running)
        c.new_token_ids.extend(random_tokens(rng, running))
        t0 = time.perf_counter()
        out = step_fn(step)
        elapsed = time.perf_counter() - t0
        if len(out.scheduled.request_ids) != running or out.preempted:
            raise RuntimeError(
                f"decode step {s}: {len(out.scheduled.request_ids)} scheduled, preempted {list(out.preempted)}"
            )
        if s >= warmup:
            times_ms.append(elapsed * 1e3)
    return times_ms


def decode_blocks(running: int, prompt_len: int, steps: int) -> int:
    return running * -(-(prompt_len + steps + 1) // BLOCK_SIZE)


# ------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", required=True, help="write the results here")
    p.add_argument("--quick", action="store_true", help="1/10 of the requests (about a minute)")
    p.add_argument("--plot", help="also write a PNG bar chart of requests/s (needs matplotlib)")
    p.add_argument("--repeats", type=int, help="passes per workload and variant (default 5)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def run_workloads(args, sizes: dict[str, int], repeats: int, workdir: str, daemons: list) -> dict[str, Any]:
    """Every workload, each variant ``repeats`` times, interleaved; one daemon per pool size."""
    results: dict[str, dict[str, Any]] = {v: {} for v in VARIANTS}
    params: dict[str, Any] = {}
    daemon: common.KvdProcess | None = None
    client: DaemonClient | None = None
    daemon_blocks = 0
    try:
        for name, n in sizes.items():
            w = build_workload(name, n, args.seed)
            params[name] = w.params
            # NOTE: the prompts are the benchmark's data, not kvd's: frozen, the
            # collector skips their ~2M references, so a full collection costs
            # what it would in the daemon (kvd's blocks and index only).
            gc.collect()
            gc.freeze()
            if daemon is None or w.num_blocks != daemon_blocks:
                if client is not None:
                    client.close()
                if daemon is not None:
                    daemon.stop()
                daemon, daemon_blocks = start_daemon(workdir, w.num_blocks, f"kvd-{name}"), w.num_blocks
                daemons.append(describe_daemon(daemon, workdir, name))
                client = DaemonClient.connect(daemon.address)
            else:  # same pool size: the same daemon, reset after every pass
                daemons[-1]["workloads"].append(name)
            runs: dict[str, list[Run]] = {v: [] for v in VARIANTS}
            for rep in range(repeats):  # interleaved: a noisy spell hits one repeat of each, not one variant
                tag = f"{name} {rep + 1}/{repeats}"
                gc.collect()
                runs["kvd_inprocess"].append(run_manager(w, f"{tag} in-process"))
                gc.collect()
                runs["kvd_inprocess_step"].append(run_steps_inprocess(w, f"{tag} in-process run_step"))
                gc.collect()
                runs["kvd_rpc"].append(run_rpc(client, w, f"{tag} rpc"))
            for variant in VARIANTS:
                results[variant][name] = summarize(runs[variant], n)
            gc.unfreeze()
            del w, runs
    finally:
        gc.unfreeze()
        if client is not None:
            client.close()
        if daemon is not None:
            daemon.stop()
    return {"results": results, "params": params}


def start_daemon(workdir: str, num_blocks: int, name: str) -> common.KvdProcess:
    flags = [
        "--metrics-port", "0", *LAYOUT_FLAGS, "--num-blocks", str(num_blocks),
        "--block-size", str(BLOCK_SIZE), "--device", "cpu", "--log-level", "warning",
    ]  # fmt: skip
    return common.KvdProcess(workdir, flags, name=name).start()


def describe_daemon(daemon: common.KvdProcess, workdir: str, workload: str) -> dict[str, Any]:
    command = " ".join(daemon.command).replace(workdir, "<tmpdir>")
    return {"workloads": [workload], "command": command, "startup_s": round(daemon.startup_s, 2)}


def run_decode(args, steps: int, workdir: str, daemons: list) -> dict[str, Any]:
    running, prompt_len, warmup = 64, 256, 20
    num_blocks = max(EVICT_BLOCKS, decode_blocks(running, prompt_len, warmup + steps))
    manager = KVCacheManager(BlockPool(num_blocks), BLOCK_SIZE)
    session = Session(session_id="bench", client_name="block_pool", last_seen=0.0)
    gc.collect()
    progress = common.Progress("decode 64 in-process run_step", 1)
    inproc = decode_steps(lambda s: run_step(manager, session, s), running, prompt_len, steps, warmup, args.seed)
    progress.done()
    daemon = start_daemon(workdir, num_blocks, "kvd-decode")
    daemons.append(describe_daemon(daemon, workdir, "step_rpc_64"))
    try:
        with DaemonClient.connect(daemon.address) as client:
            rpc_session = client.attach("block_pool-decode", map_memory=False)
            gc.collect()
            progress = common.Progress("decode 64 rpc", 1)
            rpc = decode_steps(rpc_session.step, running, prompt_len, steps, warmup, args.seed)
            progress.done()
            rpc_session.detach()
    finally:
        daemon.stop()
    params = {"running": running, "prompt_tokens": prompt_len, "steps": steps, "warmup_steps": warmup}
    params["num_blocks"] = num_blocks
    return {
        "step_rpc_64": {"p50_ms": common.median(rpc), "p99_ms": common.percentile(rpc, 99), "steps": steps},
        "step_inprocess_64": {
            "p50_ms": common.median(inproc),
            "p99_ms": common.percentile(inproc, 99),
            "steps": steps,
        },
        "params": params,
    }


def build_ratios(results: dict[str, Any]) -> dict[str, float | None]:
    inproc, steps, rpc = (results[v] for v in VARIANTS)
    ratios: dict[str, float | None] = {}
    for name in inproc:
        ratios[f"rpc_over_inprocess_requests_per_s_{name}"] = common.ratio(
            rpc[name]["requests_per_s"], inproc[name]["requests_per_s"]
        )
        ratios[f"rpc_over_inprocess_step_requests_per_s_{name}"] = common.ratio(
            rpc[name]["requests_per_s"], steps[name]["requests_per_s"]
        )
        ratios[f"inprocess_step_over_inprocess_requests_per_s_{name}"] = common.ratio(
            steps[name]["requests_per_s"], inproc[name]["requests_per_s"]
        )
    for name in ("hot", "evict"):
        if name in inproc and "cold" in inproc:
            for variant, label in (("kvd_inprocess", "inprocess"), ("kvd_rpc", "rpc")):
                ratios[f"{name}_over_cold_requests_per_s_{label}"] = common.ratio(
                    results[variant][name]["requests_per_s"], results[variant]["cold"]["requests_per_s"]
                )
    s64, i64 = results["step_rpc_64"], results["step_inprocess_64"]
    ratios["step_rpc_64_p99_over_p50"] = common.ratio(s64["p99_ms"], s64["p50_ms"])
    ratios["step_rpc_64_over_inprocess_p50"] = common.ratio(s64["p50_ms"], i64["p50_ms"])
    return ratios


def print_table(results: dict[str, Any], ratios: dict[str, float | None]) -> None:
    rows = []
    for name in results["kvd_inprocess"]:
        for variant in VARIANTS:
            r = results[variant][name]
            us = " ".join(f"{op}={v:.0f}" for op, v in r["us_per_request"].items())
            rows.append(
                [name, variant, r["requests_per_s"], r["new_blocks_per_s"], r["token_hit_rate"], r["evictions"], us]
            )
    headers = ["workload", "variant", "req/s", "new blocks/s", "hit rate", "evictions", "median us/request"]
    print(common.format_table(headers, rows))
    print()
    decode_rows = [[k, results[k]["p50_ms"], results[k]["p99_ms"]] for k in ("step_rpc_64", "step_inprocess_64")]
    print(common.format_table(["decode step, 64 running", "p50 ms", "p99 ms"], decode_rows))
    print()
    print(common.format_table(["ratio", "value"], sorted(ratios.items())))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    scale = 10 if args.quick else 1
    repeats = args.repeats or 5
    sizes = {"cold": 1000 // scale, "hot": 1000 // scale, "evict": 1500 // scale}
    decode_n = 100 if args.quick else 500
    started = time.perf_counter()
    daemons: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kvd-bench-") as workdir:
        work = run_workloads(args, sizes, repeats, workdir, daemons)
        decode = run_decode(args, decode_n, workdir, daemons)
    results = work["results"]
    results["step_rpc_64"] = decode["step_rpc_64"]
    results["step_inprocess_64"] = decode["step_inprocess_64"]
    ratios = build_ratios(results)
    checks = {
        f"same_hits_blocks_evictions_{name}": all(
            (results[v][name]["token_hit_rate"], results[v][name]["new_blocks"], results[v][name]["evictions"])
            == (r0["token_hit_rate"], r0["new_blocks"], r0["evictions"])
            for v in VARIANTS
        )
        for name, r0 in results["kvd_inprocess"].items()
    }
    report = {
        "benchmark": "block_pool",
        "quick": args.quick,
        "machine": common.machine_info(),
        "code": common.source_digest(),
        "workload": {
            "block_size": BLOCK_SIZE,
            "in_flight": IN_FLIGHT,
            "vocab": VOCAB,
            "token_budget": TOKEN_BUDGET,
            "seed": args.seed,
            "repeats": repeats,
            "lifecycle": "per request i, one step: commit request i-1's whole prompt, free request i-8, admit i",
            "timing": "us_per_request: median over repeats of the per-request median (mean in us_per_request_mean)",
            "gc": "enabled; the workload's prompts are gc.freeze()d so collections scan only kvd's objects",
            **work["params"],
            "step_rpc_64": decode["params"],
            "daemons": daemons,
            "reference": REFERENCE,
        },
        "results": common.rounded(results),
        "ratios": common.rounded(ratios),
        "checks": checks,
        "total_s": round(time.perf_counter() - started, 1),
    }
    common.write_json(args.json, report)
    print_table(results, ratios)
    if not all(checks.values()):
        common.log(f"WARNING: variants disagree on hits/blocks/evictions: {checks}")
    if args.plot:
        groups = list(results["kvd_inprocess"])
        series = {v: [results[v][g]["requests_per_s"] for g in groups] for v in VARIANTS}
        if common.bar_chart(args.plot, groups, series, "requests/s", "kvd block pool: requests/s"):
            common.log(f"plot written to {args.plot}")
    common.log(f"results written to {args.json} in {report['total_s']}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
