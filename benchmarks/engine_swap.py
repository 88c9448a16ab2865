"""Engines come and go under a steady load: the time to first token and the
cached share of prompt tokens in the window before and after each event.

    .venv/bin/python benchmarks/engine_swap.py --json FILE [--quick]

Three variants, each on a fresh stack (a daemon, float32 SmolLM2 engines, a
gateway with its embedded Redis, as separate processes):

    rolling_swap    two engines share one daemon; each in turn is drained
                    (SIGTERM) and started again on its address, the other
                    serving meanwhile;
    engine_restart  one engine on its daemon, drained and started again: the
                    daemon (and its cache) stays;
    pair_restart    one engine and its daemon both stopped and started again:
                    the cache is lost (the baseline the other two beat).

``--clients`` threads stream requests back to back through the gateway: each
one of ``--documents`` shared documents (a long prefix every client reuses)
and a question of its own, 8 greedy new tokens. A window of ``--window-s``
seconds of load is measured before the event and another once the stack
serves again; ``failed_requests`` counts every request with a status other
than OK from the first window's start to the second's end (the event
included). TTFT is from the request's sending to its first token, by the
client's clock.
"""

from __future__ import annotations

import argparse
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import harness
from harness.text import WORDS

VARIANTS = ("rolling_swap", "engine_restart", "pair_restart")
BLOCK_SIZE = 16
NEW_TOKENS = 8


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = harness.parser(__doc__, quick_help="10-second windows, 3 clients, 3 shorter documents")
    p.add_argument("--window-s", type=float, help="seconds measured before and after each event (30; quick 10)")
    p.add_argument("--clients", type=int, help="streaming clients (4; quick 3)")
    p.add_argument("--documents", type=int, help="shared documents (4; quick 3)")
    p.add_argument("--document-words", type=int, help="words per document (240; quick 160)")
    p.add_argument("--variants", default=",".join(VARIANTS), help="a comma-separated subset")
    p.add_argument("--model", default="smollm2")
    args = p.parse_args(argv)
    args.window_s = args.window_s or (10.0 if args.quick else 30.0)
    args.clients = args.clients or (3 if args.quick else 4)
    args.documents = args.documents or (3 if args.quick else 4)
    args.document_words = args.document_words or (160 if args.quick else 240)
    args.variants = [v for v in VARIANTS if v in args.variants.split(",")]
    return args


@dataclass
class Sample:
    sent_s: float
    ttft_s: float | None
    cached_tokens: int
    prompt_tokens: int
    status: str  # OK or a gRPC status name


@dataclass
class Load:
    """Client threads streaming requests through the gateway until stopped."""

    address: str
    documents: list[str]
    clients: int
    samples: list[Sample] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> None:
        for n in range(self.clients):
            thread = threading.Thread(target=self._client, args=(n,), daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(120)

    def _client(self, n: int) -> None:
        import grpc

        from gateway.client import GatewayClient

        with GatewayClient(self.address, timeout_s=120) as client:
            i = 0
            while not self._stop.is_set():
                i += 1
                prompt = self.documents[(n + i) % len(self.documents)] + f"\nQuestion {n}.{i}: what was decided?"
                sent = time.monotonic()
                ttft, usage = None, None
                try:
                    for message in client.generate(prompt, max_new_tokens=NEW_TOKENS, ignore_eos=True):
                        if ttft is None and message.token_ids:
                            ttft = time.monotonic() - sent
                        if message.HasField("usage"):
                            usage = message.usage
                    self.samples.append(Sample(sent, ttft, usage.cached_prompt_tokens, usage.prompt_tokens, "OK"))
                except grpc.RpcError as err:
                    self.samples.append(Sample(sent, None, 0, 0, err.code().name))
                    time.sleep(0.1)  # the stack is between engines: do not spin

    def window(self, start_s: float, end_s: float) -> list[Sample]:
        return [s for s in list(self.samples) if start_s <= s.sent_s < end_s]


class Stack:
    """A daemon, ``engines`` engines on it and a gateway in front of them."""

    def __init__(self, workdir: Path, model: str, engines: int) -> None:
        self.workdir = workdir
        self.model = model
        self.daemon = harness.DaemonProcess(workdir, ["--block-size", str(BLOCK_SIZE), "--num-blocks", "2048",
                                                  "--metrics-port", "0", "--log-level", "warning"])  # fmt: skip
        self.engines = [self._engine(i) for i in range(engines)]
        self.gateway = harness.GatewayProcess(
            workdir, ",".join(e.address for e in self.engines),
            ["--health-interval-s", "0.2", "--keeper-interval-s", "0.5", "--log-level", "warning"],
        )  # fmt: skip

    def _engine(self, i: int, port: int = 0) -> harness.EngineProcess:
        args = ["--model", self.model, "--dtype", "float32", "--log-level", "warning"]
        return harness.EngineProcess(self.workdir, self.daemon.address, args, name=f"engine-{i}", port=port)

    def start(self) -> None:
        self.daemon.start()
        for engine in self.engines:
            engine.start()
        self.gateway.start()

    def restart_engine(self, i: int) -> None:
        """Drains engine ``i`` (SIGTERM) and starts a new one on its address."""
        old = self.engines[i]
        old.stop(timeout_s=90)
        self.engines[i] = self._engine(i, old.port)
        self.engines[i].start()

    def restart_pair(self) -> None:
        """Stops the engine and its daemon (the cache goes with it) and starts both again."""
        old = self.engines[0]
        old.stop(timeout_s=90)
        self.daemon.stop()
        self.daemon.start()
        self.engines[0] = self._engine(0, old.port)
        self.engines[0].start()

    def stop(self) -> None:
        self.gateway.stop()
        for engine in self.engines:
            engine.stop(timeout_s=30)
        self.daemon.stop()


def documents(count: int, words: int) -> list[str]:
    """Seeded prose, one document per index (a long shared prefix each)."""
    import random

    texts = []
    for d in range(count):
        rng = random.Random(d)
        body = " ".join(rng.choice(WORDS) for _ in range(words))
        texts.append(f"Document {d}. Minutes of the {rng.choice(WORDS)} board.\n{body}\n")
    return texts


def summarize(samples: list[Sample]) -> dict[str, Any]:
    ok = [s for s in samples if s.status == "OK" and s.ttft_s is not None]
    prompt = sum(s.prompt_tokens for s in ok)
    return {
        "requests": len(samples),
        "ttft_mean_s": harness.mean([s.ttft_s for s in ok]),
        "cached_share": sum(s.cached_tokens for s in ok) / prompt if prompt else float("nan"),
    }


def run_variant(name: str, args: argparse.Namespace, docs: list[str], workdir: Path) -> dict[str, Any]:
    stack = Stack(workdir, args.model, engines=2 if name == "rolling_swap" else 1)
    try:
        stack.start()
        load = Load(stack.gateway.address, docs, args.clients)
        load.start()
        time.sleep(min(args.window_s, 10))  # every document computed once: the steady state
        before_start = time.monotonic()
        time.sleep(args.window_s)
        event_start = time.monotonic()
        harness.log(f"{name}: the event")
        if name == "rolling_swap":
            for i in range(len(stack.engines)):
                stack.restart_engine(i)
        elif name == "engine_restart":
            stack.restart_engine(0)
        else:
            stack.restart_pair()
        after_start = time.monotonic()
        time.sleep(args.window_s)
        end = time.monotonic()
        load.stop()
    finally:
        stack.stop()
    before, after = summarize(load.window(before_start, event_start)), summarize(load.window(after_start, end))
    failed = [s.status for s in load.window(before_start, end) if s.status != "OK"]
    return {
        "ttft_before_mean_s": before["ttft_mean_s"],
        "ttft_after_mean_s": after["ttft_mean_s"],
        "cached_share_before": before["cached_share"],
        "cached_share_after": after["cached_share"],
        "failed_requests": len(failed),
        "failed_by_status": {status: failed.count(status) for status in sorted(set(failed))},
        "requests_before": before["requests"],
        "requests_after": after["requests"],
        "event_s": after_start - event_start,
    }


def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """Each variant on a fresh stack in a folder of its own."""
    if args.model == "smollm2":
        from inference import model_store

        args.model = str(model_store.resolve_model("smollm2", model_store.default_cache_dir()))
    docs = documents(args.documents, args.document_words)
    results = {}
    for name in args.variants:
        harness.log(f"{name}: starting")
        folder = workdir / name[:4]
        folder.mkdir()
        results[name] = run_variant(name, args, docs, folder)
    return results


def report(args: argparse.Namespace, results: dict[str, Any]) -> dict[str, Any]:
    ratios = {
        "rolling_swap_ttft_over_before": _over_before(results.get("rolling_swap")),
        "rolling_swap_failed_requests": results.get("rolling_swap", {}).get("failed_requests"),
        "engine_restart_ttft_over_before": _over_before(results.get("engine_restart")),
        "pair_restart_ttft_over_before": _over_before(results.get("pair_restart")),
    }
    return {
        "benchmark": "engine_swap",
        "quick": args.quick,
        "machine": harness.machine_info(),
        "code": harness.source_digest(harness.STACK_SOURCES),
        "workload": {
            "window_s": args.window_s,
            "clients": args.clients,
            "documents": args.documents,
            "document_words": args.document_words,
            "new_tokens": NEW_TOKENS,
            "model": args.model,
            "dtype": "float32",
            "block_size": BLOCK_SIZE,
            "variants": args.variants,
            "ttft": "from the request's sending to its first token, by the client's clock",
            "failed_requests": "statuses other than OK from the first window's start to the second's end",
        },  # fmt: skip
        "results": harness.rounded(results),
        "ratios": harness.rounded(ratios),
    }


def table(report: dict[str, Any], json_path: str) -> str:
    rows = [
        [name, r["ttft_before_mean_s"], r["ttft_after_mean_s"], r["cached_share_before"], r["cached_share_after"],
         r["failed_requests"]]
        for name, r in report["results"].items()
    ]  # fmt: skip
    headers = ["variant", "ttft before", "ttft after", "cached before", "cached after", "failed"]
    return "\n".join([
        harness.format_table(headers, rows),
        harness.format_table(["ratio", "value"], [[k, v] for k, v in report["ratios"].items()]),
        f"results written to {json_path}",
    ])  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return harness.main(
        args, measure=run, report=report, table=lambda report: table(report, args.json), workdir_prefix="kvd-swap-"
    )


def _over_before(result: dict[str, Any] | None) -> float | None:
    return None if result is None else harness.ratio(result["ttft_after_mean_s"], result["ttft_before_mean_s"])


if __name__ == "__main__":
    import sys

    sys.exit(main())
