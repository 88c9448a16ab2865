"""Faults under mixed load: what each costs the requests in flight, how soon
the stack serves again, and that every answer stays exact.

    .venv/bin/python benchmarks/chaos.py --json FILE [--quick]

The stack, as separate processes: a redis-server of its own (AOF on, as in
compose), a daemon with the host and disk tiers on (a device pool smaller
than the prompts' blocks, so blocks move down the tiers and onto disk), two
float64 engines on it, and a gateway with its HTTP API. Clients
(``chaos_load``) stream greedy requests all along: gRPC and HTTP, plain
token prompts and templated ones, each answer checked against transformers'
``generate`` in float64. The schedule, one fault at a time, each after
``--calm-s`` of load:

    engine_kill    engine 0 SIGKILLed, started again on its address
    daemon_kill    the daemon SIGKILLed, started again on its socket with
                   the disk tier's folder kept; the engines re-attach
    gateway_kill   the gateway SIGKILLed, started again on its ports
    redis_restart  Redis SIGKILLed, started again from its AOF
    engine_drain   engine 1 drained (SIGTERM), started again on its address

A fault's window runs from the fault until the stack is whole again (every
process serving, the gateway seeing both replicas) and a request sent after
the fault has ended OK. Per fault: ``in_flight`` (requests in flight at the
fault); ``ok`` and ``failed_by_status`` (those and the requests sent in the
window); ``recovery_s`` (from the fault to that first OK answer);
``restart_s`` (from the fault until the stack is whole); ``wrong_tokens``
(the window's answers, whole or cut short). At the end, the load stopped
and the daemon settled (its lease, its quarantine): blocks held by requests,
blocks quarantined, the disk tier's corrupt files dropped, and
``corrupt_blocks_served``: wrong answers among those that read disk-tier
blocks.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import signal
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import harness
from chaos_load import DOCUMENTED, NEW_TOKENS, REQUEST_TIMEOUT_S, Attempt, Load, Prompt
from harness.text import english_like

FAULTS = ("engine_kill", "daemon_kill", "gateway_kill", "redis_restart", "engine_drain")
BLOCK_SIZE = 16
TEMPLATE = "You are the dispatcher of the northern harbour. Answer in one short sentence. " * 2
#: How long the stack may take to be whole again after a fault (model loads included).
WHOLE_TIMEOUT_S = 300.0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = harness.parser(__doc__, quick_help="short calms, fewer prompts (the suite's variant)")
    p.add_argument("--calm-s", type=float, help="seconds of load before each fault (30; quick 4)")
    p.add_argument("--prompts", type=int, help="distinct prompts, each sent plain and templated (12; quick 4)")
    p.add_argument("--grpc-clients", type=int, default=2)
    p.add_argument("--http-clients", type=int, default=1)
    p.add_argument("--faults", default=",".join(FAULTS), help="a comma-separated subset, in the schedule's order")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--workdir", help="keep the processes' logs here (default: a temporary folder)")
    args = p.parse_args(argv)
    args.calm_s = args.calm_s if args.calm_s is not None else (4.0 if args.quick else 30.0)
    args.prompts = args.prompts or (4 if args.quick else 12)
    args.faults = [f for f in args.faults.split(",") if f]
    if unknown := set(args.faults) - set(FAULTS):
        raise SystemExit(f"unknown faults: {sorted(unknown)} (known: {', '.join(FAULTS)})")
    return args


class ChaosStack:
    """The processes, each restartable on its own address."""

    def __init__(self, folder: Path, model: str, num_blocks: int) -> None:
        self.folder = folder
        self.redis = harness.RedisProcess(folder, append_only=True, append_log=True)
        self.daemon = harness.DaemonProcess(folder, [
            "--block-size", str(BLOCK_SIZE), "--num-blocks", str(num_blocks), "--host-num-blocks", str(num_blocks * 2),
            "--disk-path", str(folder / "disk"), "--lease-s", "2", "--metrics-port", "0", "--log-level", "warning",
        ])  # fmt: skip
        engine_args = ["--model", model, "--dtype", "float64", "--log-level", "warning"]
        self.engines = [
            harness.EngineProcess(folder, self.daemon.address, engine_args, name=f"engine-{i}") for i in range(2)
        ]
        # info: the replicas it sees come and go are in its log (``describe``).
        gateway_args = ["--redis-url", self.redis.url, "--log-level", "info"]
        self.gateway = harness.GatewayProcess(folder, ",".join(e.address for e in self.engines), gateway_args, True)

    def start(self) -> None:
        self.redis.start()
        self.daemon.start()
        for engine in self.engines:
            engine.start()
        self.gateway.start()

    def stop(self) -> None:
        self.gateway.stop()
        for engine in self.engines:
            engine.stop(timeout_s=60)
        self.daemon.stop()
        self.redis.stop()

    def whole(self) -> bool:
        """Every process serves and the gateway sees both replicas serving."""
        from gateway.client import GatewayClient

        if not self.redis.pings():
            return False
        try:
            with GatewayClient(self.gateway.address, timeout_s=5) as client:
                return sum(r.serving for r in client.info().replicas) == len(self.engines)
        except Exception:  # noqa: BLE001 - any failure means: not yet
            return False

    def describe(self) -> str:
        """What the gateway sees of its replicas and each process's last log
        lines: why the stack is not whole."""
        from gateway.client import GatewayClient

        try:
            with GatewayClient(self.gateway.address, timeout_s=5) as client:
                seen = ", ".join(f"{r.address} serving={r.serving}" for r in client.info().replicas)
        except Exception as exc:  # noqa: BLE001 - the answer is what failed
            seen = f"Info failed: {exc}"
        children = [self.redis, self.daemon, *self.engines, self.gateway]
        tails = "".join(f"\n--- {child.log_path.name}\n{child.log_tail(15)}" for child in children)
        return f"the gateway sees: {seen}{tails}"

    def daemon_stats(self):
        from kvd.common.client import DaemonClient

        with DaemonClient.connect(self.daemon.address) as client:
            return client.stats()


def killed(child: harness.ChildProcess) -> None:
    """SIGKILLs a harness child (then ends its process group), leaving it ready to start again."""
    child.stop(signal.SIGKILL)


def engine_kill(stack: ChaosStack) -> None:
    killed(stack.engines[0])
    stack.engines[0].start()


def daemon_kill(stack: ChaosStack) -> None:
    killed(stack.daemon)
    stack.daemon.start()


def gateway_kill(stack: ChaosStack) -> None:
    killed(stack.gateway)
    stack.gateway.start()


def redis_restart(stack: ChaosStack) -> None:
    stack.redis.stop(signal.SIGKILL)
    stack.redis.start()


def engine_drain(stack: ChaosStack) -> None:
    stack.engines[1].stop(timeout_s=90)  # SIGTERM: a drain
    stack.engines[1].start()


INJECT: dict[str, Callable[[ChaosStack], None]] = {
    "engine_kill": engine_kill,
    "daemon_kill": daemon_kill,
    "gateway_kill": gateway_kill,
    "redis_restart": redis_restart,
    "engine_drain": engine_drain,
}


# ------------------------------------------------------------------ prompts


def make_prompts(stack: ChaosStack, model_dir: str, count: int) -> list[Prompt]:
    """``count`` token prompts, each plain and after the template, with
    transformers' greedy answers, then each answer's text as the stack streams
    it (read through the stack, its tokens checked first)."""
    import random

    import grpc
    import torch
    from e2e_hf import hf_greedy

    from gateway.client import GatewayClient
    from inference import model_store
    from kvd_api.engine.v1 import engine_pb2 as epb
    from kvd_api.engine.v1 import engine_pb2_grpc as epb_grpc

    tokenizer = model_store.load_tokenizer(model_dir)
    rng = random.Random(7)
    bodies = [tokenizer.encode(english_like(rng, 6 + i % 6), add_special_tokens=False) for i in range(count)]

    with grpc.insecure_channel(stack.engines[0].address) as channel:
        tokenize = epb_grpc.EngineStub(channel).Tokenize
        template_ids = list(tokenize(epb.TokenizeRequest(text=TEMPLATE), timeout=60).token_ids)
    model = model_store.load_model(model_dir, torch.float64)
    prompts = []
    with torch.inference_mode():
        for ids in bodies:
            for template, prefix in (("", []), ("dispatch", template_ids)):
                expected = tuple(hf_greedy(model, prefix + ids, NEW_TOKENS))
                prompts.append(Prompt(tuple(ids), template, expected))
    del model
    with GatewayClient(stack.gateway.address, timeout_s=REQUEST_TIMEOUT_S) as client:
        client.create_template("dispatch", TEMPLATE)
        read = []
        for p in prompts:
            reply = client.complete(list(p.ids), template=p.template, max_new_tokens=NEW_TOKENS, ignore_eos=True)
            if tuple(reply.token_ids) != p.expected_ids:
                raise RuntimeError(f"the stack is wrong before any fault: {list(reply.token_ids)} != {p.expected_ids}")
            read.append(dataclasses.replace(p, expected_text=reply.text))
        return read


# ------------------------------------------------------------------- faults


def run_fault(stack: ChaosStack, load: Load, name: str, calm_s: float) -> dict[str, Any]:
    time.sleep(calm_s)  # load before the fault: requests in flight in every phase
    fault_at = time.monotonic()
    harness.log(f"fault: {name}")
    INJECT[name](stack)
    if not harness.wait_for(stack.whole, WHOLE_TIMEOUT_S, 0.1):
        raise RuntimeError(f"{name}: the stack was not whole again after {WHOLE_TIMEOUT_S:.0f} s; {stack.describe()}")
    whole_at = time.monotonic()
    if not harness.wait_for(lambda: load.first_ok_after(fault_at) is not None, WHOLE_TIMEOUT_S, 0.1):
        raise RuntimeError(f"{name}: no request succeeded after the fault")
    recovered_at = load.first_ok_after(fault_at)
    window_end = max(whole_at, recovered_at)
    affected = [a for a in list(load.attempts) if a.in_flight_at(fault_at) or fault_at <= a.sent <= window_end]
    harness.wait_for(lambda: all(a.ended is not None for a in affected), REQUEST_TIMEOUT_S + 10, 0.1)
    failed = Counter(a.status for a in affected if a.status != "OK")
    return {
        "in_flight": sum(a.in_flight_at(fault_at) for a in affected),
        "requests": len(affected),
        "ok": sum(a.status == "OK" for a in affected),
        "failed_by_status": dict(sorted(failed.items())),
        "recovery_s": recovered_at - fault_at,
        "restart_s": whole_at - fault_at,
        "wrong_tokens": sum(a.wrong_tokens for a in affected),
    }


def settled(stack: ChaosStack, timeout_s: float) -> dict[str, Any]:
    """The daemon's blocks once the requests are over: held by requests, quarantined."""

    def counts() -> tuple[int, int]:
        stats = stack.daemon_stats()
        return stats.num_used_blocks - stats.num_pinned_blocks, stats.num_quarantined_blocks

    harness.wait_for(lambda: counts() == (0, 0), timeout_s, 0.1)
    held, quarantined = counts()
    stats = stack.daemon_stats()
    return {"blocks_held": held, "blocks_quarantined": quarantined, "disk_corrupt_dropped": stats.disk_corrupt_blocks}


def summarize(attempts: list[Attempt]) -> dict[str, Any]:
    done = [a for a in attempts if a.ended is not None]
    undocumented = Counter(a.status for a in done if a.status != "OK" and a.status not in DOCUMENTED)
    from_disk = [a for a in done if a.disk_tokens > 0]
    return {
        "requests": len(done),
        "ok": sum(a.status == "OK" for a in done),
        "by_client": dict(Counter(a.client for a in done)),
        "wrong_tokens": sum(a.wrong_tokens for a in done),
        "undocumented": dict(undocumented),
        "requests_with_disk_tokens": len(from_disk),
        "corrupt_blocks_served": sum(a.wrong_tokens > 0 for a in from_disk),
    }


def run(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    """The schedule's faults one after another under load, then the daemon settled."""
    model = args.model
    if model == "smollm2":
        from inference import model_store

        model = str(model_store.resolve_model("smollm2", model_store.default_cache_dir()))
    # A device pool of a few prompts' blocks: the others move to the host tier and disk.
    stack = ChaosStack(folder, model, num_blocks=48 if args.quick else 96)
    started = time.monotonic()
    try:
        stack.start()
        prompts = make_prompts(stack, model, args.prompts)
        from gateway.client import GatewayClient

        with GatewayClient(stack.gateway.address) as client:
            served = client.info().model
        load = Load(stack.gateway.address, stack.gateway.http_address, served, prompts,
                    args.grpc_clients, args.http_clients)  # fmt: skip
        load.start()
        try:
            results = {name: run_fault(stack, load, name, args.calm_s) for name in args.faults}
        finally:
            load.stop()
        after = settled(stack, timeout_s=120)
    finally:
        with contextlib.suppress(Exception):
            stack.stop()
    return {"model": model, "prompt_lengths": [len(p.ids) for p in prompts], "faults": results, "after": after,
            "all": summarize(load.attempts), "run_s": round(time.monotonic() - started, 1)}  # fmt: skip


def report(args: argparse.Namespace, measured: dict[str, Any]) -> dict[str, Any]:
    results, after, total = measured["faults"], measured["after"], measured["all"]
    lengths = measured["prompt_lengths"]
    after["corrupt_blocks_served"] = total["corrupt_blocks_served"]
    after["requests_with_disk_tokens"] = total["requests_with_disk_tokens"]
    ratios = {
        "wrong_tokens_total": total["wrong_tokens"],
        "undocumented_statuses": sum(total["undocumented"].values()),
        "worst_recovery_s": max((r["recovery_s"] for r in results.values()), default=None),
    }
    workload = {
        "faults": args.faults,
        "calm_s": args.calm_s,
        "prompts": f"{args.prompts} token prompts of {min(lengths)}-{max(lengths)} tokens, each plain and templated",
        "clients": {"grpc_streaming": args.grpc_clients, "http_streaming": args.http_clients},
        "new_tokens": NEW_TOKENS,
        "engines": "2 on one daemon, float64 (exact against transformers' generate in float64)",
        "daemon": "device and host tiers (host: twice the device pool) and a disk tier; lease 2 s",
        "model": measured["model"],
        "run_s": measured["run_s"],
        "documented_statuses": sorted(DOCUMENTED),
    }
    return harness.stack_report("chaos", args.quick, workload,
                                harness.rounded({"faults": results, "after": after, "all": total}),
                                harness.rounded(ratios))  # fmt: skip


def table(report: dict[str, Any], json_path: str) -> str:
    results, after = report["results"]["faults"], report["results"]["after"]
    rows = [[name, r["in_flight"], r["ok"], r["failed_by_status"] or "-", r["recovery_s"], r["restart_s"],
             r["wrong_tokens"]] for name, r in results.items()]  # fmt: skip
    headers = ["fault", "in flight", "ok", "failed", "recovery s", "whole again s", "wrong tokens"]
    return "\n".join([
        harness.format_table(headers, harness.rounded(rows, 2)),
        harness.format_table(["after", "value"], [[k, v] for k, v in after.items()]),
        harness.format_table(["ratio", "value"], [[k, v] for k, v in harness.rounded(report["ratios"], 2).items()]),
        f"results written to {json_path}",
    ])  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return harness.main(
        args, measure=run, report=report, table=lambda report: table(report, args.json), workdir_prefix="kvd-chaos-"
    )


if __name__ == "__main__":
    import sys

    sys.exit(main())
