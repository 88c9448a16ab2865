"""e2e.py's kvd variants: a daemon and an engine serving the workload, prefix caching off or on.

Every request streams from its own client thread, all released together
(``run_concurrent``); then, on the caching engine, a cold and a warm request
per prefix, one at a time (``run_warm_cold``).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import harness
from e2e_workload import BLOCK_SIZE, Run, Workload
from harness.streams import RPC_TIMEOUT_S, Stream, stream

from kvd.common.defaults import TOKEN_BUDGET
from kvd_api.engine.v1 import engine_pb2_grpc as pb_grpc


def run_concurrent(stub, label: str, prompts: list[list[int]], new_tokens: int, salt: bytes) -> Run:
    """Every prompt in its own thread, released together at t = 0; TTFT is the
    client's: t0 to the first streamed message with tokens. The cache salt
    keeps one round's blocks from serving the next (each round starts cold)."""
    streams: list[Stream | None] = [None] * len(prompts)
    go = threading.Event()
    lock = threading.Lock()
    progress = harness.Progress(label, len(prompts))

    def worker(i: int) -> None:
        go.wait()
        streams[i] = stream(stub, prompts[i], new_tokens, salt)
        with lock:
            progress.advance()

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(len(prompts))]
    for t in threads:
        t.start()
    time.sleep(0.2)  # every thread is parked on the event
    t0 = time.perf_counter()
    go.set()
    for t in threads:
        t.join(RPC_TIMEOUT_S + 30)
    progress.done()
    errors = [s.error if s is not None else "no result" for s in streams if s is None or s.error]
    if errors:
        raise RuntimeError(f"{len(errors)} of {len(prompts)} requests failed: {errors[0]}")
    run = Run()
    run.total_s = max(s.finished_at for s in streams) - t0
    for s in streams:
        run.tokens.append(s.tokens)
        run.ttft_s.append(s.first_token_at - t0)
        run.prompt_tokens.append(s.usage.prompt_tokens)
        run.cached_tokens.append(s.usage.cached_prompt_tokens)
    server_ttft = [s.usage.time_to_first_token_s for s in streams]
    run.extra.update(
        server_ttft_mean_s=harness.mean(server_ttft), server_ttft_p90_s=harness.percentile(server_ttft, 90)
    )
    return run


def run_warm_cold(stub, w: Workload, new_tokens: int) -> dict[str, Any]:
    """Per prefix: a cold request (prefix never seen), then a warm one (same
    prefix, another suffix), one at a time on an idle engine."""
    cold, warm, cold_server, warm_server, warm_cached, cold_cached = [], [], [], [], [], []
    progress = harness.Progress("kvd warm/cold", 2 * len(w.warm_cold))
    for prefix, cold_suffix, warm_suffix in w.warm_cold:
        for suffix, ttft, server, cached in (
            (cold_suffix, cold, cold_server, cold_cached),
            (warm_suffix, warm, warm_server, warm_cached),
        ):
            t0 = time.perf_counter()
            s = stream(stub, prefix + suffix, new_tokens)
            if s.error:
                raise RuntimeError(f"warm/cold request failed: {s.error}")
            ttft.append(s.first_token_at - t0)
            server.append(s.usage.time_to_first_token_s)
            cached.append(s.usage.cached_prompt_tokens)
            progress.advance()
    progress.done()
    return {
        "ttft_cold_s": harness.median(cold),
        "ttft_warm_s": harness.median(warm),
        "prefix_tokens": len(w.warm_cold[0][0]),
        "suffix_tokens": len(w.warm_cold[0][1]),
        "repeats": len(cold),
        "ttft_cold_all_s": cold,
        "ttft_warm_all_s": warm,
        "server_ttft_cold_s": harness.median(cold_server),
        "server_ttft_warm_s": harness.median(warm_server),
        "cached_tokens_cold": cold_cached,
        "cached_tokens_warm": warm_cached,
    }


#: Lines of a log kept with a failure (a Triton compile error alone is ~30).
LOG_TAIL_LINES = 200


def graph_mode(engine_log: str) -> str:
    """What an engine's log says of its CUDA graphs: ``captured``, ``eager``
    (the capture failed: every step ran eagerly) or ``off`` (never tried)."""
    if "captured CUDA graphs" in engine_log:
        return "captured"
    return "eager" if "CUDA graph capture failed" in engine_log else "off"


class EngineVariant:
    """A kvd daemon and engine serving one variant for every round: started
    by ``start``, stopped by ``stop``."""

    def __init__(
        self,
        name: str,
        model_path: Path,
        num_blocks: int,
        prefix_caching: bool,
        workdir: str,
        device: str,
        dtype: str,
        token_budget: int = TOKEN_BUDGET,
        max_num_seqs: int = 64,
    ) -> None:
        self.name = name
        folder = os.path.join(workdir, name)
        os.makedirs(folder, exist_ok=True)
        daemon_flags = [
            "--metrics-port", "0", "--block-size", str(BLOCK_SIZE), "--num-blocks", str(num_blocks),
            "--device", device, "--log-level", "warning",
        ]  # fmt: skip
        engine_flags = ["--model", str(model_path), "--dtype", dtype, "--device", device]
        engine_flags += ["--token-budget", str(token_budget), "--max-num-seqs", str(max_num_seqs)]
        if not prefix_caching:
            engine_flags.append("--no-prefix-caching")
        self.workdir = workdir
        self.daemon = harness.DaemonProcess(folder, daemon_flags, name="kvd")
        self.engine = harness.EngineProcess(folder, self.daemon.address, engine_flags, name="engine")
        self.channel = None
        self.stub = None

    def start(self, warmup: list[int]) -> dict[str, Any]:
        """Starts both processes and sends one untimed warm-up request.

        Returns:
            How they were launched (for the report).
        """
        self.daemon.start()
        self.engine.start()
        self.channel = grpc.insecure_channel(self.engine.address)
        self.stub = pb_grpc.EngineStub(self.channel)
        warm = stream(self.stub, warmup, 4)
        if warm.error:
            raise RuntimeError(f"warm-up request failed: {warm.error}")
        return {
            "variant": self.name,
            "daemon": " ".join(self.daemon.command).replace(self.workdir, "<tmpdir>"),
            "engine": " ".join(self.engine.command).replace(self.workdir, "<tmpdir>").replace(sys.executable, "python"),
            "engine_startup_s": round(self.engine.startup_s, 2),
            "cuda_graphs": graph_mode(self.engine.log_path.read_text(errors="replace")),
        }

    def run(self, w: Workload, new_tokens: int, round_index: int) -> Run:
        run = run_concurrent(self.stub, self.name, w.prompts, new_tokens, f"e2e-round-{round_index}".encode())
        if self.engine.process is None or self.engine.process.poll() is not None:
            raise RuntimeError("the engine exited")
        return run

    def warm_cold(self, w: Workload, new_tokens: int) -> dict[str, Any]:
        return run_warm_cold(self.stub, w, new_tokens)

    def logs(self) -> str:
        engine, daemon = self.engine.log_tail(LOG_TAIL_LINES), self.daemon.log_tail(LOG_TAIL_LINES)
        return f"--- engine log ---\n{engine}\n--- kvd log ---\n{daemon}"

    def stop(self) -> None:
        if self.channel is not None:
            self.channel.close()
        self.engine.stop()
        self.daemon.stop()
