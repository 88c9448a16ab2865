"""A soak through the whole stack: many streaming clients, three tenants, cancels,
expiring deadlines and clients that vanish, for minutes; then nothing held.

    .venv/bin/python benchmarks/load.py --json benchmarks/results/load.json [--duration-s 300] [--quick]

One daemon (with a host tier), one float32 SmolLM2 engine and one gateway
(API keys for three tenants, embedded Redis), as separate processes. Each
tenant has a template. ``--clients`` threads (64) each send streaming
requests back to back until the time is up, each request drawn at random:

- half templated (the tenant's template + a short prompt), half plain;
- 10% cancelled after their first message;
- 5% with a deadline too short to finish (DEADLINE_EXCEEDED expected);
- 5% dropped without closing: the client's channel is closed mid-stream, as
  when a client process dies.

Statuses other than OK, CANCELLED and DEADLINE_EXCEEDED are errors (the
script exits 1 on any). Resident memory of each process is read after the
warm-up (the first 20% of the run, at least 10 s) and at the end, and sampled
every ``--sample-s`` seconds (``memory_series``: RSS, and RSS less the shared
KV cache, per process; the host tier's used slots), so a levelling off or a
steady climb shows. After the run: the blocks requests still hold in each tier
(pins excluded) must be 0.

This is a soak, not a timed test: the figures depend on the machine (report
them with its load). ``--quick``: 30 seconds, 16 clients.
"""

from __future__ import annotations

import argparse
import json
import random
import secrets
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import harness
from harness.text import WORDS

TENANTS = ("acme", "globex", "initech")
EXPECTED = frozenset({"OK", "CANCELLED", "DEADLINE_EXCEEDED"})


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = harness.parser(__doc__, quick_help="30 seconds, 16 clients")
    p.add_argument("--duration-s", type=float, help="default 300; quick 30")
    p.add_argument("--clients", type=int, help="concurrent streaming clients (default 64; quick 16)")
    p.add_argument("--max-new-tokens", type=int, default=16, help="the most tokens a request asks for")
    p.add_argument("--workdir", help="keep the processes' logs here (default: a temporary folder)")
    p.add_argument("--seed", type=int, default=11)
    p.add_argument("--sample-s", type=float, default=5.0, help="seconds between memory samples")
    p.add_argument("--model", default="smollm2")
    return p.parse_args(argv)


@dataclass
class Tally:
    """What the clients saw; one lock for all of it."""

    statuses: Counter = field(default_factory=Counter)
    behaviours: Counter = field(default_factory=Counter)
    ttfts: list[float] = field(default_factory=list)
    output_tokens: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, behaviour: str, status: str, ttft: float | None, tokens: int) -> None:
        with self.lock:
            self.behaviours[behaviour] += 1
            self.statuses[status] += 1
            self.output_tokens += tokens
            if ttft is not None:
                self.ttfts.append(ttft)


def prompt(rng: random.Random) -> str:
    return " " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 40))) + "."


def one_request(address: str, key: str, template: str | None, rng: random.Random, max_new: int, tally: Tally) -> None:
    import grpc

    from gateway.client import GatewayClient

    roll = rng.random()
    behaviour = "cancel" if roll < 0.10 else "deadline" if roll < 0.15 else "drop" if roll < 0.20 else "normal"
    timeout = rng.uniform(0.05, 0.5) if behaviour == "deadline" else 120.0
    client = GatewayClient(address, api_key=key, timeout_s=timeout)
    kwargs = {"template": template} if template else {}
    start = time.perf_counter()
    ttft, tokens, status = None, 0, "OK"
    try:
        stream = client.generate(prompt(rng), max_new_tokens=rng.randint(4, max_new), ignore_eos=True, **kwargs)
        for message in stream:
            if message.token_ids and ttft is None:
                ttft = time.perf_counter() - start
            tokens += len(message.token_ids)
            if behaviour == "cancel":
                stream.cancel()
            elif behaviour == "drop":
                client.channel.close()  # the client vanishes mid-stream
    except grpc.RpcError as err:
        status = err.code().name
    except ValueError:  # iterating a stream whose channel was closed
        status = "CANCELLED"
    finally:
        client.channel.close()
    if behaviour == "drop" and status != "OK":
        status = "CANCELLED"  # closing the channel shows up client-side as a cancel
    tally.add(behaviour, status, ttft if status == "OK" else None, tokens)


def client_loop(n: int, address: str, keys: dict[str, str], args, stop: threading.Event, tally: Tally) -> None:
    rng = random.Random(args.seed * 1000 + n)
    while not stop.is_set():
        tenant = rng.choice(TENANTS)
        template = f"{tenant}-bot" if rng.random() < 0.5 else None
        one_request(address, keys[tenant], template, rng, args.max_new_tokens, tally)


def memory_mb(pids: dict[str, int]) -> dict[str, dict[str, float]]:
    """Resident and unique memory of each process, in MiB.

    NOTE: RSS counts the pages of the shared-memory KV cache a process maps
    (the daemon and the engine both map all of it from the start, as the
    daemon does its host tier: kvd/common/memory.py, kvd/offload.py), so it is fixed
    after start unless something leaks. USS (pages only this process maps)
    moves as pages of the shared cache become or stop being shared.
    """
    import psutil

    out = {}
    for name, pid in pids.items():
        process = psutil.Process(pid)
        info = process.memory_full_info()
        # The KV cache is a shared-memory file (kvd-*.kv): what is left is the
        # process's own memory (model, Python heap, host tier, buffers).
        cache = sum(m.rss for m in process.memory_maps(grouped=True) if m.path.endswith(".kv"))
        out[name] = {"rss": info.rss / 2**20, "uss": info.uss / 2**20, "rss_without_cache": (info.rss - cache) / 2**20}
    return out


def memory_sample(pids: dict[str, int], daemon_address: str, elapsed: float) -> dict[str, Any]:
    """One point of the memory time series: RSS and RSS less the shared KV
    cache per process (MiB), and the host tier's used slots."""
    from kvd.common.client import DaemonClient

    sample: dict[str, Any] = {"t_s": round(elapsed, 1)}
    for name, mb in memory_mb(pids).items():
        sample[name] = {"rss": round(mb["rss"], 1), "rss_without_cache": round(mb["rss_without_cache"], 1)}
    with DaemonClient.connect(daemon_address) as client:
        stats = client.stats()
    sample["host_slots_used"] = stats.num_host_blocks - stats.num_host_free_blocks
    return sample


def held_blocks(daemon_address: str) -> dict[str, int]:
    """Blocks requests still hold in each tier (pins excluded), once nothing runs."""
    from kvd.common.client import DaemonClient

    with DaemonClient.connect(daemon_address) as client:
        for _ in range(100):
            stats = client.stats()
            if stats.num_requests == 0 and stats.num_copying_blocks == 0 and stats.num_host_blocks_read == 0:
                break
            time.sleep(0.1)
    return {
        "device": stats.num_used_blocks - stats.num_pinned_blocks,
        "device_copying": stats.num_copying_blocks,
        "host_being_read": stats.num_host_blocks_read,
        "requests": stats.num_requests,
    }


def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    from gateway.client import GatewayClient
    from inference import model_store

    duration = args.duration_s or (30.0 if args.quick else 300.0)
    clients = args.clients or (16 if args.quick else 64)
    warmup = max(10.0, 0.2 * duration)
    model_dir = model_store.resolve_model(args.model, model_store.default_cache_dir())
    keys = {tenant: f"{tenant}-{secrets.token_hex(8)}" for tenant in TENANTS}
    keys_file = workdir / "keys.json"
    entries = [{"key": k, "tenant": t, "scopes": ["generate", "templates:write"]} for t, k in keys.items()]
    keys_file.write_text(json.dumps({"keys": entries}))
    daemon_args = ["--block-size", "16", "--num-blocks", "2048", "--host-num-blocks", "1024", "--metrics-port", "0"]
    engine_args = ["--model", str(model_dir), "--max-num-seqs", str(clients)]
    tally = Tally()
    with (
        harness.DaemonProcess(workdir, daemon_args) as kvd,
        harness.EngineProcess(workdir, kvd.address, engine_args) as engine,
        harness.GatewayProcess(workdir, engine.address, ["--api-keys", str(keys_file)]) as gateway,
    ):
        for tenant, key in keys.items():
            with GatewayClient(gateway.address, api_key=key, timeout_s=300) as client:
                client.create_template(f"{tenant}-bot", f"You are the assistant of {tenant}. " * 6)
        pids = {"daemon": kvd.process.pid, "engine": engine.process.pid, "gateway": gateway.process.pid}
        stop = threading.Event()
        threads = [
            threading.Thread(target=client_loop, args=(n, gateway.address, keys, args, stop, tally), daemon=True)
            for n in range(clients)
        ]
        start = time.perf_counter()
        for thread in threads:
            thread.start()
        progress = harness.Progress(f"load: {clients} clients for {duration:.0f}s", int(duration))
        rss_warm = None
        series = [memory_sample(pids, kvd.address, 0.0)]
        while (elapsed := time.perf_counter() - start) < duration:
            time.sleep(1.0)
            if rss_warm is None and elapsed >= warmup:
                rss_warm = memory_mb(pids)
            if elapsed - series[-1]["t_s"] >= args.sample_s:
                series.append(memory_sample(pids, kvd.address, elapsed))
            progress.advance()
        stop.set()
        for thread in threads:
            thread.join(timeout=180)
        wall = time.perf_counter() - start
        progress.done(f"{sum(tally.statuses.values())} requests")
        held = held_blocks(kvd.address)
        rss_end = memory_mb(pids)
        series.append(memory_sample(pids, kvd.address, time.perf_counter() - start))
    rss_warm = rss_warm or rss_end
    errors = {code: n for code, n in tally.statuses.items() if code != "OK"}
    soak = {
        "duration_s": wall,
        "clients": clients,
        "requests_ok": tally.statuses["OK"],
        "errors_by_status": errors,
        "unexpected_errors": sum(n for code, n in errors.items() if code not in EXPECTED),
        "behaviours": dict(tally.behaviours),
        "ttft_p50_s": harness.percentile(tally.ttfts, 50) if tally.ttfts else None,
        "ttft_p99_s": harness.percentile(tally.ttfts, 99) if tally.ttfts else None,
        "output_tokens_per_s": tally.output_tokens / wall,
        "blocks_held_after": held,
        "memory_warm_mb": rss_warm,
        "memory_end_mb": rss_end,
        "memory_series": series,
        "rss_growth_ratio": {name: rss_end[name]["rss"] / rss_warm[name]["rss"] - 1 for name in rss_end},
        "uss_growth_ratio": {name: rss_end[name]["uss"] / rss_warm[name]["uss"] - 1 for name in rss_end},
        "rss_without_cache_growth_ratio": {
            name: rss_end[name]["rss_without_cache"] / rss_warm[name]["rss_without_cache"] - 1 for name in rss_end
        },
    }
    return {
        "benchmark": "load",
        "quick": bool(args.quick),
        "machine": harness.machine_info(),
        "workload": {
            "duration_s": duration, "clients": clients, "tenants": list(TENANTS), "templated_share": 0.5,
            "cancelled_share": 0.10, "expiring_deadline_share": 0.05, "dropped_share": 0.05,
            "max_new_tokens": args.max_new_tokens, "warmup_s": warmup, "seed": args.seed, "model": model_dir.name,
            "source": harness.source_digest(harness.STACK_SOURCES),
        },
        "results": {"soak": soak},
        "ratios": {},
    }  # fmt: skip


def table(data: dict[str, Any]) -> str:
    soak = data["results"]["soak"]
    rows = [
        ["requests OK", soak["requests_ok"]],
        ["errors by status", json.dumps(soak["errors_by_status"])],
        ["TTFT p50 / p99 (s)", f"{soak['ttft_p50_s']} / {soak['ttft_p99_s']}"],
        ["output tokens/s", soak["output_tokens_per_s"]],
        ["blocks held after", json.dumps(soak["blocks_held_after"])],
        ["RSS growth after warm-up", json.dumps(harness.rounded(soak["rss_growth_ratio"], 3))],
        ["USS growth after warm-up", json.dumps(harness.rounded(soak["uss_growth_ratio"], 3))],
        ["RSS without the KV cache", json.dumps(harness.rounded(soak["rss_without_cache_growth_ratio"], 3))],
    ]
    return harness.format_table(["soak", "value"], rows)


def unexpected_errors_or_leaks(_args: argparse.Namespace, data: dict[str, Any]) -> int:
    """1 when a request failed with an undocumented status or a block stayed held."""
    soak = data["results"]["soak"]
    held = soak["blocks_held_after"]
    leaked = held["device"] or held["device_copying"] or held["host_being_read"] or held["requests"]
    return 1 if soak["unexpected_errors"] or leaked else 0


def main(argv: list[str] | None = None) -> int:
    return harness.main(
        parse_args(argv),
        measure=run,
        report=lambda _args, data: data,
        table=table,
        verdict=unexpected_errors_or_leaks,
        workdir_prefix="kvd-load-",
    )


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.exit(main())
