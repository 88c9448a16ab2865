"""The gateway's HTTP API against its gRPC API: time to first token, output
tokens/s and the time the HTTP layer adds per streamed token.

    .venv/bin/python benchmarks/http_api.py --json benchmarks/results/http_api.json [--quick]

One daemon, one float32 SmolLM2 engine and one gateway serving both APIs (the
HTTP one on its second listener). The same workload goes through gRPC
``Generate`` (``gateway.client``, a thread per client) and through HTTP
streaming with the ``openai`` async client (``/v1/completions`` with the same
token ids, ``stream_options.include_usage``), at 1, 16 and 64 concurrent
clients; at each, the two variants alternate round by round on the same
processes, so the machine's noise hits them alike. Every request has a prompt
of its own (the same length for both: neither finds the other's blocks),
greedy, EOS ignored, so each produces exactly ``new_tokens`` tokens.

Then, on the same processes, the field's own client (``vllm bench serve``,
``benchmarks/field_client.py``; its virtualenv is made on first use) runs
the same prompt and output lengths at 16 concurrent requests through
``/v1/completions`` and ``/v1/chat/completions``, and its own metrics are
reported as it names them (``results.field_client``; ``--no-field-client``
leaves it out).

Per variant and concurrency: p50/p90 time to first token (the first message
or chunk carrying tokens, as the client sees it), output tokens/s (tokens
over the batch's wall time), p50 time between tokens within a stream, and the
gateway process's CPU seconds per output token. ``http_added_s_per_token``
is HTTP's p50 time between tokens minus gRPC's: what the HTTP layer adds to
each streamed token. Targets: HTTP p50 TTFT <= 1.1x gRPC's and output
tokens/s >= 0.95x gRPC's at every concurrency.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import harness
from harness.text import english_like, exact_tokens

VARIANTS = ("grpc", "http")


@dataclass
class Timed:
    """One request as its client saw it."""

    start: float
    first: float | None = None
    arrivals: list[float] = field(default_factory=list)  # each message / chunk carrying tokens
    tokens: int = 0
    error: str | None = None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first is None else self.first - self.start

    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.arrivals, self.arrivals[1:], strict=False)]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = harness.parser(__doc__)
    p.add_argument("--concurrency", default="1,16,64", help="comma-separated client counts")
    p.add_argument("--requests-per-client", type=int, help="requests each client sends per round (default 2; quick 1)")
    p.add_argument("--min-requests", type=int, help="requests per variant and round at least (default 8; quick 4)")
    p.add_argument("--prompt-tokens", type=int, help="default 128; quick 32")
    p.add_argument("--new-tokens", type=int, help="default 64; quick 16")
    p.add_argument("--rounds", type=int, help="turns per concurrency (default 2, quick too)")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--no-field-client", action="store_true", help="leave out vllm bench serve")
    p.add_argument("--field-prompts", type=int, help="vllm bench serve's prompts per backend (default 32; quick 8)")
    return p.parse_args(argv)


def grpc_one(client, prompt: list[int], new_tokens: int) -> Timed:
    import grpc

    t = Timed(time.perf_counter())
    try:
        for message in client.generate(prompt, max_new_tokens=new_tokens, ignore_eos=True):
            if message.token_ids:
                now = time.perf_counter()
                t.first = t.first or now
                t.arrivals.append(now)
            if message.HasField("usage"):
                t.tokens = message.usage.completion_tokens
    except grpc.RpcError as err:
        t.error = f"{err.code().name}: {err.details()}"
    return t


async def http_one(client, model: str, prompt: list[int], new_tokens: int) -> Timed:
    import openai

    t = Timed(time.perf_counter())
    try:
        stream = await client.completions.create(
            model=model, prompt=prompt, max_tokens=new_tokens, stream=True, temperature=0,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )  # fmt: skip
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].finish_reason is None:
                now = time.perf_counter()
                t.first = t.first or now
                t.arrivals.append(now)
            if chunk.usage is not None:
                t.tokens = chunk.usage.completion_tokens
    except openai.APIError as err:
        t.error = f"{type(err).__name__}: {err}"
    return t


def run_grpc(address: str, prompts: list[list[int]], new_tokens: int, clients: int) -> list[Timed]:
    from gateway.client import GatewayClient

    with GatewayClient(address, timeout_s=900) as client, ThreadPoolExecutor(clients) as pool:
        return list(pool.map(lambda p: grpc_one(client, p, new_tokens), prompts))


def run_http(base_url: str, model: str, prompts: list[list[int]], new_tokens: int, clients: int) -> list[Timed]:
    import httpx2
    import openai

    async def main() -> list[Timed]:
        limits = httpx2.Limits(max_connections=clients, max_keepalive_connections=clients)
        http_client = openai.DefaultAsyncHttpxClient(limits=limits, timeout=900)
        async with openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, http_client=http_client) as c:
            gate = asyncio.Semaphore(clients)

            async def one(prompt: list[int]) -> Timed:
                async with gate:
                    return await http_one(c, model, prompt, new_tokens)

            return list(await asyncio.gather(*(one(p) for p in prompts)))

    return asyncio.run(main())


def summarize(timed: list[Timed], wall_s: float, cpu_s: float) -> dict[str, Any]:
    ok = [t for t in timed if t.error is None]
    tokens = sum(t.tokens for t in ok)
    ttfts = [t.ttft_s for t in ok if t.ttft_s is not None]
    gaps = [g for t in ok for g in t.gaps()]
    return {
        "requests": len(timed),
        "errors": len(timed) - len(ok),
        "output_tokens": tokens,
        "ttft_p50_s": harness.median(ttfts),
        "ttft_p90_s": harness.percentile(ttfts, 90),
        "output_tokens_per_s": tokens / wall_s if wall_s else None,
        "inter_token_p50_s": harness.median(gaps),
        "gateway_cpu_s_per_token": cpu_s / tokens if tokens else None,
        "wall_s": wall_s,
    }


def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    import openai

    from inference import model_store

    quick = args.quick
    levels = [int(c) for c in args.concurrency.split(",")]
    per_client = args.requests_per_client or (1 if quick else 2)
    prompt_len = args.prompt_tokens or (32 if quick else 128)
    new_tokens = args.new_tokens or (16 if quick else 64)
    rounds = args.rounds or 2
    least = args.min_requests or (4 if quick else 8)  # one client's single request would be all noise
    batch_size = {c: max(c * per_client, least) for c in levels}
    model_dir = model_store.resolve_model(args.model, model_store.default_cache_dir())
    tokenizer = model_store.load_tokenizer(model_dir)
    rng = random.Random(args.seed)

    def prompt() -> list[int]:  # distinct prompts: no request finds another's blocks
        return exact_tokens(tokenizer, english_like(rng, 6), prompt_len, rng)

    most = max(levels)
    blocks = max(2048, 3 * most * (prompt_len + new_tokens) // 16)
    timed: dict[str, dict[int, list[Timed]]] = {v: {c: [] for c in levels} for v in VARIANTS}
    wall = {v: dict.fromkeys(levels, 0.0) for v in VARIANTS}
    cpu = {v: dict.fromkeys(levels, 0.0) for v in VARIANTS}
    with (
        harness.DaemonProcess(
            workdir, ["--block-size", "16", "--num-blocks", str(blocks), "--metrics-port", "0"]
        ) as kvd,
        harness.EngineProcess(workdir, kvd.address, ["--model", str(model_dir), "--max-num-seqs", str(most)]) as engine,
        harness.GatewayProcess(workdir, engine.address, http=True) as gateway,
    ):
        base_url = f"http://{gateway.http_address}/v1"
        model = openai.OpenAI(base_url=base_url, api_key="none").models.list().data[0].id
        # Warm-up (not measured): both paths once, the gateway's tokenizer and the HTTP stack loaded.
        run_grpc(gateway.address, [prompt()], new_tokens, 1)
        run_http(base_url, model, [prompt()], new_tokens, 1)
        progress = harness.Progress("http_api: interleaved rounds", sum(batch_size.values()) * rounds * 2)
        for clients in levels:
            for r in range(rounds):
                for variant in harness.turn_order(VARIANTS, r):
                    batch = [prompt() for _ in range(batch_size[clients])]
                    cpu_before = harness.process_cpu_s(gateway.process.pid)
                    start = time.perf_counter()
                    if variant == "grpc":
                        got = run_grpc(gateway.address, batch, new_tokens, clients)
                    else:
                        got = run_http(base_url, model, batch, new_tokens, clients)
                    wall[variant][clients] += time.perf_counter() - start
                    cpu[variant][clients] += harness.process_cpu_s(gateway.process.pid) - cpu_before
                    timed[variant][clients] += got
                    progress.advance(len(batch))
        progress.done()
        results_n = measure_n_forks(kvd, base_url, model, lambda: prompt(), new_tokens)
        results_ll = measure_loglikelihood(kvd, base_url, model, lambda: prompt())
        field = None if args.no_field_client else run_field_client(args, base_url, model, model_dir, prompt_len,
                                                                   new_tokens)  # fmt: skip
    results: dict[str, Any] = {
        v: {f"c{c}": summarize(timed[v][c], wall[v][c], cpu[v][c]) for c in levels} for v in VARIANTS
    }
    ratios: dict[str, Any] = {}
    results["added"] = {}
    for c in levels:
        g, h = results["grpc"][f"c{c}"], results["http"][f"c{c}"]
        ratios[f"ttft_p50_http_over_grpc_c{c}"] = harness.ratio(h["ttft_p50_s"], g["ttft_p50_s"])
        ratios[f"output_tokens_per_s_http_over_grpc_c{c}"] = harness.ratio(
            h["output_tokens_per_s"], g["output_tokens_per_s"]
        )
        results["added"][f"c{c}"] = {
            "http_added_s_per_token": h["inter_token_p50_s"] - g["inter_token_p50_s"],
            "http_added_cpu_s_per_token": (h["gateway_cpu_s_per_token"] or 0) - (g["gateway_cpu_s_per_token"] or 0),
        }
    workload = {
        "concurrency": levels,
        "requests_per_variant_and_round": {f"c{c}": n for c, n in batch_size.items()},
        "rounds": rounds,
        "prompt_tokens": prompt_len,
        "new_tokens": new_tokens,
        "seed": args.seed,
        "model": model_dir.name,
        "dtype": "float32",
        "grpc": "gateway.client Generate, a thread per client",
        "http": "openai AsyncOpenAI completions, stream with include_usage, token-id prompt",
    }
    results["n_forks"] = results_n
    ratios["n8_over_separate"] = harness.ratio(results_n["n8_s"], results_n["separate8_s"])
    workload["n_forks"] = ("one /v1/completions request with n = 8 against 8 concurrent requests of one prompt each "
                           "(a fresh prompt each, sampled, seeded, EOS ignored); prefill_tokens: prompt tokens the "
                           "daemon computed (looked up minus served by the cache)")  # fmt: skip
    results["loglikelihood"] = results_ll
    ratios["loglikelihood_shared_over_separate"] = harness.ratio(
        results_ll["one_context_4_choices_s"], results_ll["separate_4_s"]
    )
    workload["loglikelihood"] = (f"lm-eval's loglikelihood request (token ids, echo, logprobs 1, max_tokens 1): one "
                                 f"context of {CONTEXT_PROMPTS} prompts with {CHOICES} choices of {CHOICE_TOKENS} "
                                 f"tokens in one /v1/completions request against {CHOICES} concurrent requests of one "
                                 "choice each (a fresh context each); prefill_tokens as for n_forks")  # fmt: skip
    if field is not None:
        workload["field_client"], results["field_client"] = field
    return {"workload": workload, "results": results, "ratios": ratios}


FIELD_CONCURRENCY = 16
FORKS = 8


def computed(kvd, run) -> tuple[float, int]:
    """Runs ``run``: its seconds, and the prompt tokens the daemon computed meanwhile (looked up less served)."""
    with kvd.client() as c:
        before = c.stats()
    start = time.perf_counter()
    run()
    seconds = time.perf_counter() - start
    with kvd.client() as c:
        after = c.stats()
    return seconds, (after.query_tokens - before.query_tokens) - (after.hit_tokens - before.hit_tokens)


def measure_n_forks(kvd, base_url: str, model: str, prompt, new_tokens: int) -> dict[str, Any]:
    """``n = 8`` in one request against 8 separate requests of the same prompt:
    seconds and the prompt tokens the daemon computed for each."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=900)
    args = {"model": model, "max_tokens": new_tokens, "temperature": 1, "seed": 1, "extra_body": {"ignore_eos": True}}

    one = prompt()
    n8_s, n8_prefill = computed(kvd, lambda: client.completions.create(prompt=one, n=FORKS, **args))
    other = prompt()
    with ThreadPoolExecutor(FORKS) as pool:
        separate = lambda: list(pool.map(lambda _: client.completions.create(prompt=other, **args), range(FORKS)))  # noqa: E731
        separate8_s, separate8_prefill = computed(kvd, separate)
    return {"n8_s": n8_s, "separate8_s": separate8_s, "n8_prefill_tokens": n8_prefill,
            "separate8_prefill_tokens": separate8_prefill, "prompt_tokens": len(one)}  # fmt: skip


CHOICES = 4
CHOICE_TOKENS = 8
CONTEXT_PROMPTS = 4  # a context as long as this many of the workload's prompts


def measure_loglikelihood(kvd, base_url: str, model: str, prompt) -> dict[str, Any]:
    """An lm-eval-style loglikelihood batch (one context, 4 choices) in one
    request against 4 separate requests: seconds and the prompt tokens the
    daemon computed for each (a scored position is computed, never cached)."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=900)
    args = {"model": model, "max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": True}

    def choices() -> list[list[int]]:
        context = [t for _ in range(CONTEXT_PROMPTS) for t in prompt()]
        return [context + prompt()[:CHOICE_TOKENS] for _ in range(CHOICES)]

    client.completions.create(prompt=choices()[0], **args)  # warm-up: the gateway loads what echo decodes with
    together = choices()
    shared_s, shared_prefill = computed(kvd, lambda: client.completions.create(prompt=together, **args))
    apart = choices()
    with ThreadPoolExecutor(CHOICES) as pool:
        separate = lambda: list(pool.map(lambda p: client.completions.create(prompt=p, **args), apart))  # noqa: E731
        separate_s, separate_prefill = computed(kvd, separate)
    return {"one_context_4_choices_s": shared_s, "separate_4_s": separate_s,
            "one_context_4_choices_prefill_tokens": shared_prefill, "separate_4_prefill_tokens": separate_prefill,
            "prompt_tokens": len(together[0])}  # fmt: skip


def run_field_client(args, base_url: str, model: str, model_dir: Path, prompt_len: int, new_tokens: int):
    """``vllm bench serve`` against the gateway, completions and chat: (its workload, its metrics)."""
    import field_client

    python = field_client.ensure_client()
    prompts = args.field_prompts or (8 if args.quick else 32)
    root = base_url.removesuffix("/v1")
    metrics = {
        backend: field_client.serve_bench(
            python,
            field_client.BenchRun(
                root,
                model,
                model_dir,
                prompt_len,
                new_tokens,
                prompts,
                FIELD_CONCURRENCY,
                backend=backend,
                seed=args.seed,
            ),
        )  # fmt: skip
        for backend in ("openai", "openai-chat")
    }
    backends = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}
    workload = {"client": field_client.client_version(python), "dataset": "random", "num_prompts": prompts,
                "max_concurrency": FIELD_CONCURRENCY, "input_len": prompt_len, "output_len": new_tokens,
                "ignore_eos": True, "backends": backends}  # fmt: skip
    return workload, {"kvd": metrics}


def table(results: dict[str, Any], ratios: dict[str, Any], levels: list[int]) -> str:
    rows = []
    for c in levels:
        g, h, a = results["grpc"][f"c{c}"], results["http"][f"c{c}"], results["added"][f"c{c}"]
        rows.append([c, g["ttft_p50_s"], h["ttft_p50_s"], ratios[f"ttft_p50_http_over_grpc_c{c}"],
                     g["output_tokens_per_s"], h["output_tokens_per_s"],
                     ratios[f"output_tokens_per_s_http_over_grpc_c{c}"], a["http_added_s_per_token"] * 1e3,
                     g["errors"] + h["errors"]])  # fmt: skip
    headers = ["clients", "grpc ttft p50 s", "http ttft p50 s", "http/grpc", "grpc tok/s", "http tok/s",
               "http/grpc", "added ms/token", "errors"]  # fmt: skip
    out = harness.format_table(headers, rows)
    forks = results.get("n_forks")
    if forks:
        out += (f"\n\nn = {FORKS} in one request: {forks['n8_s']:.2f} s, {forks['n8_prefill_tokens']} prompt tokens "
                f"computed; {FORKS} separate requests: {forks['separate8_s']:.2f} s, "
                f"{forks['separate8_prefill_tokens']} (prompt {forks['prompt_tokens']} tokens)")  # fmt: skip
    ll = results.get("loglikelihood")
    if ll:
        out += (f"\nloglikelihood, 1 context and {CHOICES} choices in one request: "
                f"{ll['one_context_4_choices_s']:.2f} s, {ll['one_context_4_choices_prefill_tokens']} prompt tokens "
                f"computed; {CHOICES} separate requests: {ll['separate_4_s']:.2f} s, "
                f"{ll['separate_4_prefill_tokens']} (prompt {ll['prompt_tokens']} tokens)")  # fmt: skip
    field = results.get("field_client", {}).get("kvd")
    if field:
        keys = ["completed", "failed", "request_throughput", "output_throughput", "mean_ttft_ms", "mean_tpot_ms"]
        out += "\n\nvllm bench serve against kvd\n" + harness.format_table(
            ["backend", *keys], [[backend, *(m[k] for k in keys)] for backend, m in field.items()]
        )
    return out


def report(args: argparse.Namespace, measured: dict[str, Any]) -> dict[str, Any]:
    workload, results, ratios = measured["workload"], measured["results"], measured["ratios"]
    return harness.rounded(harness.stack_report("http_api", args.quick, workload, results, ratios))


def errors(_args: argparse.Namespace, report: dict[str, Any]) -> int:
    """1 when a request failed (the field client's included)."""
    results = report["results"]
    failed = sum(by_level["errors"] for v in VARIANTS for by_level in results[v].values())
    failed += sum(m.get("failed") or 0 for m in results.get("field_client", {}).get("kvd", {}).values())
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    return harness.main(
        parse_args(argv),
        measure=run,
        report=report,
        table=lambda report: table(report["results"], report["ratios"], report["workload"]["concurrency"]),
        verdict=errors,
        workdir_prefix="kvd-bench-http-",
    )


if __name__ == "__main__":
    sys.exit(main())
