"""Block-pool benchmark: how fast kvd admits, commits and frees requests.

Three seeded workloads (block size 16, 8 requests in flight; see
``block_pool_workloads.py``):

    cold   every prompt is 2048 random tokens: no reuse;
    hot    one shared 1536-token prefix + 512 unique tokens (~75% token hits);
    evict  one of 32 Zipf(s=1.0) 1024-token prefixes + 1024 unique tokens in a
           pool of 4096 blocks: constant eviction.

Each runs these ways, taking turns repeat by repeat (the machine is noisy;
every other turn runs them in reverse order):

    kvd_inprocess               KVCacheManager calls, each operation timed;
    kvd_inprocess_step          kvd.scheduler.run_step, one Step per request
                                (what the daemon does per Step, without gRPC);
    kvd_rpc                     one Step RPC per request to a kvd subprocess;
    kvd_inprocess_step_batched  run_step, 8 new requests per Step, as an
    kvd_rpc_batched             engine sends a burst, in-process and RPC;
    vllm_inprocess              vLLM's KVCacheManager on the same workload
                                (only with --vllm-python: block_pool_vllm.py).

Request i is one step: commit request i-1's whole prompt, free request i-8,
admit request i (whole prompt, one chunk), so 8 requests hold blocks between
steps (the batched variants: each Step commits and finishes the previous
Step's admissions and sends the next 8). Through Steps (protocol v2) a prompt
is sent once, as a new request (prompt only), and the daemon schedules it.
Ratios against vLLM are paired: one per turn, from passes run next to each
other, then the median.

``step_rpc_64`` times decode Steps of 64 running requests (64 commits of one
sampled token + 64 one-token appends), each followed by an empty call on the
same channel (``grpc_empty_rtt``: the health check). ``waiting`` puts 256
requests of 8,000 tokens in front of a pool for 16 (``block_pool_waiting.py``).

    .venv/bin/python benchmarks/block_pool.py --json FILE [--quick] [--plot FILE]
        [--vllm-python /tmp/vllmvenv/bin/python]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import block_pool_steps as steps
import block_pool_waiting as waiting
import block_pool_workloads as wl
import harness
from block_pool_vllm import VllmWorker
from block_pool_workloads import BLOCK_SIZE, EVICT_BLOCKS, IN_FLIGHT, TOKEN_BUDGET, VOCAB, Run, Workload
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvd.block_pool import BlockPool
from kvd.cache_manager import KVCacheManager
from kvd.common.client import DaemonClient
from kvd.scheduler import run_step
from kvd.session import Session
from kvd_api.daemon.v1 import daemon_pb2 as pb

LAYOUT_FLAGS = ["--num-layers", "1", "--num-kv-heads", "1", "--head-dim", "8"]
KVD_VARIANTS = ("kvd_inprocess", "kvd_inprocess_step", "kvd_rpc", "kvd_inprocess_step_batched", "kvd_rpc_batched")
VLLM = "vllm_inprocess"
#: variants that walk the per-request lifecycle exactly: same hits, blocks and evictions.
SAME_LIFECYCLE = ("kvd_inprocess", "kvd_inprocess_step", "kvd_rpc", VLLM)


# ------------------------------------------------------------------- runs
def run_manager(w: Workload, label: str) -> Run:
    """KVCacheManager calls: hash (new_request), admit, commit, free, each timed."""
    manager = KVCacheManager(BlockPool(w.num_blocks), BLOCK_SIZE)
    n = len(w.prompts)
    run = Run(op_us={op: [] for op in ("hash", "admit", "commit", "free")})
    t_hash, t_admit, t_commit, t_free = (run.op_us[op] for op in ("hash", "admit", "commit", "free"))
    requests: list[Any] = [None] * n
    clock = time.perf_counter_ns
    progress = harness.Progress(label, n)
    start, cpu_start = clock(), time.process_time()
    for commit, frees, admit in wl.schedule(n):
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
    run.wall_s, run.cpu_s = (clock() - start) / 1e9, time.process_time() - cpu_start
    progress.done()
    run.prompt_tokens = sum(map(len, w.prompts))
    run.evictions = manager.pool.num_evictions
    assert manager.pool.num_free == w.num_blocks, "blocks leaked"
    return run


def run_steps_inprocess(w: Workload, label: str, batched: bool = False) -> Run:
    """run_step on a fresh manager: the daemon's work per Step, minus gRPC."""
    manager = KVCacheManager(BlockPool(w.num_blocks), BLOCK_SIZE)
    session = Session(session_id="bench", client_name="block_pool", last_seen=0.0)
    drive = steps.drive_batched if batched else steps.drive_per_request
    run = drive(w, label, lambda step: run_step(manager, session, step))
    run.evictions = manager.pool.num_evictions
    assert manager.pool.num_free == w.num_blocks, "blocks leaked"
    return run


def run_rpc(daemon: Daemon, w: Workload, label: str, batched: bool = False) -> Run:
    """Step RPCs through a session of the daemon, which is reset after."""
    client = daemon.client
    session = client.attach("block_pool-bench", map_memory=False)
    before = client.stats()
    drive = steps.drive_batched if batched else steps.drive_per_request
    daemon_cpu = daemon.cpu_s()
    run = drive(w, label, session.step)
    run.cpu_s += daemon.cpu_s() - daemon_cpu
    after = client.stats()
    session.detach()
    client.stub.Reset(pb.ResetRequest())  # the next pass starts with an empty cache
    run.evictions = after.evictions - before.evictions
    query = after.query_tokens - before.query_tokens
    run.extra["stats_token_hit_rate"] = (after.hit_tokens - before.hit_tokens) / query if query else 0.0
    return run


def run_vllm(worker: VllmWorker, w: Workload, seed: int, label: str) -> Run:
    progress = harness.Progress(label, 1)
    answer = worker.run(w.name, len(w.prompts), seed)
    progress.done()
    counts = ("wall_s", "cpu_s", "prompt_tokens", "cached_tokens", "new_blocks")
    run = Run(evictions=None, **{k: answer[k] for k in counts})
    run.op_us = answer["op_us"]
    return run


def summarize(runs: list[Run], requests: int) -> dict[str, Any]:
    """Medians over repeats; counts come from the first repeat (they are deterministic)."""
    first = runs[0]
    out: dict[str, Any] = {
        "requests_per_s": harness.median([requests / r.wall_s for r in runs]),
        "new_blocks_per_s": harness.median([r.new_blocks / r.wall_s for r in runs]),
        "cpu_requests_per_s": harness.median([requests / r.cpu_s for r in runs]),
        "token_hit_rate": first.cached_tokens / first.prompt_tokens,
        "evictions": first.evictions,
        "us_per_request": {op: harness.median([harness.median(r.op_us[op]) for r in runs]) for op in first.op_us},
        "us_per_request_mean": {op: harness.median([harness.mean(r.op_us[op]) for r in runs]) for op in first.op_us},
        "wall_s": harness.median([r.wall_s for r in runs]),
        "requests": requests,
        "new_blocks": first.new_blocks,
        "repeats": len(runs),
        "deterministic": all(
            (r.cached_tokens, r.new_blocks, r.evictions) == (first.cached_tokens, first.new_blocks, first.evictions)
            for r in runs
        ),
    }
    for key in first.extra:
        out[key] = harness.median([r.extra[key] for r in runs])
    return out


# -------------------------------------------------------------- workloads


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = harness.parser(__doc__, quick_help="1/10 of the requests (about a minute)")
    p.add_argument("--plot", help="also write a PNG bar chart of requests/s (needs matplotlib)")
    p.add_argument("--repeats", type=int, help="turns per workload (default 5)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--vllm-python",
        help="a python that imports vLLM's KVCacheManager (bash /work/shared/vllm-venv/setup_vllm_venv.sh "
        "/tmp/vllmvenv makes one): adds vllm_inprocess and the paired ratios against it",
    )
    return p.parse_args(argv)


def run_workloads(
    args, sizes: dict[str, int], repeats: int, workdir: str, daemons: list, vllm: VllmWorker | None
) -> dict[str, Any]:
    """Every workload, each variant ``repeats`` times in turns; one daemon per pool size."""
    variants = [*KVD_VARIANTS, *([VLLM] if vllm else [])]
    results: dict[str, dict[str, Any]] = {v: {} for v in variants}
    turns: dict[str, dict[str, list[tuple[float, float]]]] = {}
    params: dict[str, Any] = {}
    daemon: Daemon | None = None
    try:
        for name, n in sizes.items():
            w = wl.build_workload(name, n, args.seed)
            params[name] = w.params
            # NOTE: the prompts are the benchmark's data, not kvd's: frozen, the
            # collector skips their ~2M references, so a full collection costs
            # what it would in the daemon (kvd's blocks and index only).
            gc.collect()
            gc.freeze()
            if daemon is None or w.num_blocks != daemon.num_blocks:
                if daemon is not None:
                    daemon.close()
                daemon = Daemon(workdir, w.num_blocks, f"kvd-{name}")
                daemons.append(daemon.describe(workdir, name))
            else:  # same pool size: the same daemon, reset after every pass
                daemons[-1]["workloads"].append(name)
            runs = run_turns(w, variants, repeats, args.seed, daemon, vllm)
            for variant in variants:
                results[variant][name] = summarize(runs[variant], n)
            turns[name] = {v: [(n / r.wall_s, n / r.cpu_s) for r in rs] for v, rs in runs.items()}
            gc.unfreeze()
            del w, runs
    finally:
        gc.unfreeze()
        if daemon is not None:
            daemon.close()
    return {"results": results, "turns": turns, "params": params}


def run_turns(
    w: Workload, variants: list[str], repeats: int, seed: int, daemon: Daemon, vllm: VllmWorker | None
) -> dict[str, list[Run]]:
    passes: dict[str, Callable[[str], Run]] = {
        "kvd_inprocess": lambda label: run_manager(w, label),
        "kvd_inprocess_step": lambda label: run_steps_inprocess(w, label),
        "kvd_rpc": lambda label: run_rpc(daemon, w, label),
        "kvd_inprocess_step_batched": lambda label: run_steps_inprocess(w, label, batched=True),
        "kvd_rpc_batched": lambda label: run_rpc(daemon, w, label, batched=True),
        VLLM: lambda label: run_vllm(vllm, w, seed, label),
    }
    runs: dict[str, list[Run]] = {v: [] for v in variants}
    for turn in range(repeats):
        for variant in harness.turn_order(variants, turn):
            gc.collect()
            runs[variant].append(passes[variant](f"{w.name} {turn + 1}/{repeats} {variant}"))
    return runs


class Daemon:
    """A kvd subprocess with a pool of ``num_blocks`` and a client connected to it."""

    def __init__(self, workdir: str, num_blocks: int, name: str) -> None:
        flags = [
            "--metrics-port", "0", *LAYOUT_FLAGS, "--num-blocks", str(num_blocks),
            "--block-size", str(BLOCK_SIZE), "--device", "cpu", "--log-level", "warning",
        ]  # fmt: skip
        self.daemon = harness.DaemonProcess(workdir, flags, name=name).start()
        self.num_blocks = num_blocks
        try:
            self.client = DaemonClient.connect(self.daemon.address)
        except BaseException:
            self.daemon.stop()
            raise

    def cpu_s(self) -> float:
        assert self.daemon.process is not None
        return harness.process_cpu_s(self.daemon.process.pid)

    def describe(self, workdir: str, workload: str) -> dict[str, Any]:
        command = " ".join(self.daemon.command).replace(workdir, "<tmpdir>")
        return {"workloads": [workload], "command": command, "startup_s": round(self.daemon.startup_s, 2)}

    def close(self) -> None:
        self.client.close()
        self.daemon.stop()


# ------------------------------------------------------------------ decode


def empty_call(client: DaemonClient) -> Callable[[], float]:
    """A timer of one empty unary call (the health check) on the client's channel; returns ms."""
    check = health_pb2_grpc.HealthStub(client.channel).Check
    request = health_pb2.HealthCheckRequest()

    def timed() -> float:
        t0 = time.perf_counter()
        check(request)
        return (time.perf_counter() - t0) * 1e3

    return timed


def run_decode(args, num_steps: int, workdir: str, daemons: list) -> dict[str, Any]:
    running, prompt_len, warmup = 64, 256, 20
    num_blocks = max(EVICT_BLOCKS, steps.decode_blocks(running, prompt_len, warmup + num_steps))
    manager = KVCacheManager(BlockPool(num_blocks), BLOCK_SIZE)
    session = Session(session_id="bench", client_name="block_pool", last_seen=0.0)
    gc.collect()
    progress = harness.Progress("decode 64 in-process run_step", 1)
    inproc = steps.decode_steps(
        lambda s: run_step(manager, session, s), running, prompt_len, num_steps, warmup, args.seed
    )
    progress.done()
    daemon = Daemon(workdir, num_blocks, "kvd-decode")
    daemons.append(daemon.describe(workdir, "step_rpc_64"))
    rtt: list[float] = []
    try:
        rpc_session = daemon.client.attach("block_pool-decode", map_memory=False)
        ping = empty_call(daemon.client)
        for _ in range(warmup):
            ping()
        gc.collect()
        progress = harness.Progress("decode 64 rpc + empty calls", 1)
        rpc = steps.decode_steps(
            rpc_session.step, running, prompt_len, num_steps, warmup, args.seed, lambda: rtt.append(ping())
        )
        progress.done()
        rpc_session.detach()
    finally:
        daemon.close()
    params = {"running": running, "prompt_tokens": prompt_len, "steps": num_steps, "warmup_steps": warmup}
    params["num_blocks"] = num_blocks
    params["empty_call"] = "grpc.health.v1.Health/Check on the Step's channel, one after each timed Step"
    return {
        "step_rpc_64": {"p50_ms": harness.median(rpc), "p99_ms": harness.percentile(rpc, 99), "steps": num_steps},
        "step_inprocess_64": {
            "p50_ms": harness.median(inproc),
            "p99_ms": harness.percentile(inproc, 99),
            "steps": num_steps,
        },
        "grpc_empty_rtt": {"p50_ms": harness.median(rtt), "p99_ms": harness.percentile(rtt, 99), "calls": len(rtt)},
        "params": params,
    }


# ----------------------------------------------------------------- waiting


def run_waiting(args, num_steps: int, repeats: int, workdir: str, daemons: list) -> dict[str, Any]:
    """In-process (hashes counted) and RPC (bytes on the wire) passes, in turns."""
    shape = waiting.Shape()
    daemon = Daemon(workdir, shape.num_blocks, "kvd-waiting")
    daemons.append(daemon.describe(workdir, "waiting"))
    inproc: list[waiting.WaitingRun] = []
    rpc: list[waiting.WaitingRun] = []
    try:
        for turn in range(repeats):
            for variant in harness.turn_order(["inprocess", "rpc"], turn):
                gc.collect()
                progress = harness.Progress(f"waiting {turn + 1}/{repeats} {variant}", 1)
                if variant == "inprocess":
                    inproc.append(waiting.run_inprocess(shape, num_steps, args.seed))
                else:
                    rpc.append(_waiting_rpc(daemon, shape, num_steps, args.seed))
                progress.done()
    finally:
        daemon.close()
    # A short queue (16 waiting while the first 16 run): what a Step costs
    # should not grow with the queue. Compared over the Steps before the
    # first requests finish, so the same number run in both.
    short = dataclasses.replace(shape, requests=2 * shape.pool_requests)
    compared = min(num_steps, shape.max_new_tokens)
    progress = harness.Progress(f"waiting, {short.requests} requests, in-process", 1)
    short_run = waiting.run_inprocess(short, compared, args.seed)
    by_depth = {
        str(short.requests): waiting.summarize([short_run], short, compared),
        str(shape.requests): waiting.summarize(inproc[:1], shape, compared),
    }
    progress.done()
    keys = ("steady_steps", "waiting_requests_steady_min", "request_bytes_per_step", "hashes_per_step", "step_p50_ms")
    return {
        "kvd_inprocess_step": {
            **waiting.summarize(inproc, shape),
            "by_queue": {n: {k: d[k] for k in keys} for n, d in by_depth.items()},
        },
        "kvd_rpc": waiting.summarize(rpc, shape),
        "same_steps": all(r.trace == inproc[0].trace for r in inproc + rpc),
        "params": shape.params(num_steps),
    }


def _waiting_rpc(daemon: Daemon, shape: waiting.Shape, num_steps: int, seed: int) -> waiting.WaitingRun:
    session = daemon.client.attach("block_pool-waiting", map_memory=False)
    try:
        return waiting.run(
            session.step,
            shape,
            num_steps,
            seed,
            request_bytes=lambda msg: msg.ByteSize(),  # session_id included: the RPC set it
            daemon_cpu_s=daemon.cpu_s,
        )
    finally:
        session.detach()
        daemon.client.stub.Reset(pb.ResetRequest())


# ----------------------------------------------------------------- report


def paired_ratios(turns: dict[str, dict[str, list[tuple[float, float]]]]) -> dict[str, dict[str, Any]]:
    """Per workload and kvd variant: its requests/s over vLLM's, turn by turn,
    by the clock and by CPU time (requests per CPU second of all its processes)."""
    paired: dict[str, dict[str, Any]] = {}
    for name, by_variant in turns.items():
        if VLLM not in by_variant:
            continue
        paired[name] = {}
        for variant in KVD_VARIANTS:
            pairs = list(zip(by_variant[variant], by_variant[VLLM], strict=True))
            wall = [k[0] / v[0] for k, v in pairs]
            cpu = [k[1] / v[1] for k, v in pairs]
            paired[name][variant] = {
                "median": harness.median(wall),
                "per_turn": wall,
                "cpu_median": harness.median(cpu),
                "cpu_per_turn": cpu,
            }
    return paired


def build_ratios(results: dict[str, Any], paired: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    inproc, inproc_step, rpc = (results[v] for v in ("kvd_inprocess", "kvd_inprocess_step", "kvd_rpc"))
    rpc_batched, step_batched = results["kvd_rpc_batched"], results["kvd_inprocess_step_batched"]
    ratios: dict[str, float | None] = {}
    rps = "requests_per_s"
    for name in inproc:
        ratios[f"rpc_over_inprocess_requests_per_s_{name}"] = harness.ratio(rpc[name][rps], inproc[name][rps])
        ratios[f"rpc_over_inprocess_step_requests_per_s_{name}"] = harness.ratio(rpc[name][rps], inproc_step[name][rps])
        ratios[f"inprocess_step_over_inprocess_requests_per_s_{name}"] = harness.ratio(
            inproc_step[name][rps], inproc[name][rps]
        )
        ratios[f"rpc_batched_over_rpc_requests_per_s_{name}"] = harness.ratio(rpc_batched[name][rps], rpc[name][rps])
        ratios[f"rpc_batched_over_inprocess_step_batched_requests_per_s_{name}"] = harness.ratio(
            rpc_batched[name][rps], step_batched[name][rps]
        )
    for name, by_variant in paired.items():
        for variant, label in (
            ("kvd_inprocess", "inprocess"),
            ("kvd_inprocess_step", "inprocess_step"),
            ("kvd_rpc", "rpc"),
            ("kvd_rpc_batched", "rpc_batched"),
        ):
            ratios[f"{label}_over_vllm_requests_per_s_{name}"] = by_variant[variant]["median"]
            ratios[f"{label}_over_vllm_cpu_requests_per_s_{name}"] = by_variant[variant]["cpu_median"]
    for name in ("hot", "evict"):
        if name in inproc and "cold" in inproc:
            for variant, label in (("kvd_inprocess", "inprocess"), ("kvd_rpc", "rpc")):
                ratios[f"{name}_over_cold_requests_per_s_{label}"] = harness.ratio(
                    results[variant][name][rps], results[variant]["cold"][rps]
                )
    s64, i64 = results["step_rpc_64"], results["step_inprocess_64"]
    ratios["step_rpc_64_p99_over_p50"] = harness.ratio(s64["p99_ms"], s64["p50_ms"])
    ratios["step_rpc_64_over_inprocess_p50"] = harness.ratio(s64["p50_ms"], i64["p50_ms"])
    ratios["step_64_over_empty_rtt"] = harness.ratio(s64["p50_ms"], results["grpc_empty_rtt"]["p50_ms"])
    return ratios


def table(report: dict[str, Any]) -> str:
    results, ratios = report["results"], report["ratios"]
    variants = [v for v in (*KVD_VARIANTS, VLLM) if v in results]
    rows = []
    for name in results["kvd_inprocess"]:
        for variant in variants:
            r = results[variant][name]
            us = " ".join(f"{op}={v:.0f}" for op, v in r["us_per_request"].items())
            rows.append(
                [name, variant, r["requests_per_s"], r["cpu_requests_per_s"], r["token_hit_rate"], r["evictions"], us]
            )
    headers = ["workload", "variant", "req/s", "req/cpu-s", "hit rate", "evictions", "median us/request (step)"]
    decode_rows = [
        [k, results[k]["p50_ms"], results[k]["p99_ms"]] for k in ("step_rpc_64", "step_inprocess_64", "grpc_empty_rtt")
    ]
    waiting_rows = [
        [
            v,
            r["step_p50_ms"],
            r["step_p99_ms"],
            r.get("daemon_cpu_ms_per_step"),
            r.get("request_bytes_per_step"),
            r.get("hashes_per_step"),
        ]
        for v, r in ((v, results[v]["waiting"]) for v in ("kvd_rpc", "kvd_inprocess_step"))
    ]
    waiting_headers = ["waiting (256 x 8000)", "p50 ms", "p99 ms", "daemon cpu ms", "bytes/step", "hashes/step"]
    return "\n\n".join([
        harness.format_table(headers, rows),
        harness.format_table(["decode step, 64 running", "p50 ms", "p99 ms"], decode_rows),
        harness.format_table(waiting_headers, waiting_rows),
        harness.format_table(["ratio", "value"], sorted(ratios.items())),
    ])  # fmt: skip


def consistency_checks(results: dict[str, Any], variants: list[str]) -> dict[str, bool]:
    checks = {}
    for name, r0 in results["kvd_inprocess"].items():
        same = [v for v in SAME_LIFECYCLE if v in variants]
        checks[f"same_hits_blocks_{name}"] = all(
            (results[v][name]["token_hit_rate"], results[v][name]["new_blocks"])
            == (r0["token_hit_rate"], r0["new_blocks"])
            for v in same
        )
        checks[f"same_evictions_{name}"] = all(
            results[v][name]["evictions"] == r0["evictions"] for v in same if v != VLLM
        )
    return checks


def measure(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """The workloads, the decode step and the waiting requests, each on daemons of its own in ``workdir``."""
    started = time.perf_counter()
    scale = 10 if args.quick else 1
    repeats = args.repeats or 5
    sizes = {"cold": 1000 // scale, "hot": 1000 // scale, "evict": 1500 // scale}
    decode_n = 100 if args.quick else 500
    waiting_steps, waiting_repeats = (40, 2) if args.quick else (200, 3)
    daemons: list[dict[str, Any]] = []
    folder = str(workdir)
    vllm = VllmWorker(args.vllm_python, f"{folder}/vllm-worker.log") if args.vllm_python else None
    if vllm is None:
        harness.log("vllm_inprocess skipped: no --vllm-python given (no ratios against vLLM)")
    try:
        work = run_workloads(args, sizes, repeats, folder, daemons, vllm)
    finally:
        if vllm is not None:
            vllm.close()
    decode = run_decode(args, decode_n, folder, daemons)
    wait = run_waiting(args, waiting_steps, waiting_repeats, folder, daemons)
    return {"work": work, "decode": decode, "wait": wait, "daemons": daemons, "repeats": repeats,
            "vllm": vllm.info if vllm else "not run (no --vllm-python)", "started": started}  # fmt: skip


def report(args: argparse.Namespace, measured: dict[str, Any]) -> dict[str, Any]:
    work, decode, wait = measured["work"], measured["decode"], measured["wait"]
    results = work["results"]
    variants = list(results)
    for key in ("step_rpc_64", "step_inprocess_64", "grpc_empty_rtt"):
        results[key] = decode[key]
    results["kvd_rpc"]["waiting"] = wait["kvd_rpc"]
    results["kvd_inprocess_step"]["waiting"] = wait["kvd_inprocess_step"]
    paired = paired_ratios(work["turns"])
    results["paired_over_vllm"] = paired
    ratios = build_ratios(results, paired)
    checks = consistency_checks({v: results[v] for v in variants}, variants)
    checks["waiting_same_steps_inprocess_and_rpc"] = wait["same_steps"]
    return {
        "benchmark": "block_pool",
        "quick": args.quick,
        "machine": harness.machine_info(),
        "code": harness.source_digest(),
        "workload": {
            "block_size": BLOCK_SIZE,
            "in_flight": IN_FLIGHT,
            "vocab": VOCAB,
            "token_budget": TOKEN_BUDGET,
            "seed": args.seed,
            "repeats": measured["repeats"],
            "lifecycle": "per request i, one step: commit request i-1's whole prompt, free request i-8, admit i",
            "lifecycle_batched": "per Step: commit and free the previous Step's admissions, offer the next 8",
            "turns": "each repeat is one turn of every variant; every other turn in reverse order",
            "timing": "us_per_request: median over repeats of the per-request median (mean in us_per_request_mean)",
            "gc": "enabled; the workload's prompts are gc.freeze()d so collections scan only kvd's objects",
            "vllm": measured["vllm"],
            **work["params"],
            "step_rpc_64": decode["params"],
            "waiting": wait["params"],
            "daemons": measured["daemons"],
        },
        "results": harness.rounded(results),
        "ratios": harness.rounded(ratios),
        "checks": checks,
        "total_s": round(time.perf_counter() - measured["started"], 1),
    }


def verdict(args: argparse.Namespace, report: dict[str, Any]) -> int:
    """0, after a warning for a failed consistency check and the plot, if asked for."""
    checks, results = report["checks"], report["results"]
    if not all(checks.values()):
        harness.log(f"WARNING: consistency checks failed: {checks}")
    if args.plot:
        groups = list(results["kvd_inprocess"])
        variants = [v for v in (*KVD_VARIANTS, VLLM) if v in results]
        series = {v: [results[v][g]["requests_per_s"] for g in groups] for v in variants}
        if harness.bar_chart(args.plot, groups, series, "requests/s", "block pool: requests/s"):
            harness.log(f"plot written to {args.plot}")
    harness.log(f"results written to {args.json} in {report['total_s']}s")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return harness.main(args, measure=measure, report=report, table=table, verdict=verdict)


if __name__ == "__main__":
    sys.exit(main())
