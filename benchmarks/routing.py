"""Routing across engine replicas: cached-token ratio and time to first token
with cost and prefix-affinity routing vs round-robin, and a single replica.

    .venv/bin/python benchmarks/routing.py --json benchmarks/results/routing.json [--quick]

Processes: two replicas (each a daemon + a float32 SmolLM2 engine) and a single
replica whose daemon has the two replicas' pools together (the same total KV
memory). Each variant has a gateway of its own in front of them:

- ``round_robin``: the two replicas, ``--routing round-robin``;
- ``affinity``: the two replicas, ``--routing affinity`` (the previous default);
- ``cost``: the two replicas, ``--routing cost`` (the default);
- ``single``: the single replica.

Workload, the same for every variant: 8 templates of the same length,
created through the gateway (each pinned on one replica); 200 requests, each
a template chosen by a Zipf law (seeded) followed by distinct text, a few
output tokens, several in flight. The pools are sized so that affinity
matters: one replica holds half the templates plus its requests' blocks, not
all of them, so a round-robin split (every template wanted on both replicas)
evicts cold templates' copies; the single replica, with twice the blocks,
holds all of them.

The variants run one after another on the same processes (cache state makes
interleaving requests meaningless); between two, the templates are deleted and
the daemons reset, so each starts from empty caches. With ``--rounds 2`` (the
default) the order runs forward then backward, so a drift in the machine's
speed (other work on a shared box) weighs on every variant alike; each
variant's figures are the medians over its rounds.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import harness
from harness.text import WORDS

BLOCK = 16


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = harness.parser(__doc__)
    p.add_argument("--requests", type=int, help="requests per variant (default 200; quick 40)")
    p.add_argument("--templates", type=int, default=8)
    p.add_argument("--template-tokens", type=int, help="default 256; quick 128")
    p.add_argument("--prompt-tokens", type=int, default=48, help="distinct tokens after the template")
    p.add_argument("--max-new-tokens", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    p.add_argument("--zipf-s", type=float, default=1.0, help="the Zipf exponent of template popularity")
    p.add_argument("--seed", type=int, default=11)
    p.add_argument("--rounds", type=int, default=2, help="runs of every variant, in alternating order")
    p.add_argument("--model", default="smollm2")
    return p.parse_args(argv)


def words(rng: random.Random, tokenizer, num_tokens: int) -> str:
    """Seeded English-like text of about ``num_tokens`` tokens."""
    ids = tokenizer.encode(" ".join(rng.choice(WORDS) for _ in range(num_tokens * 2)), add_special_tokens=False)
    return tokenizer.decode(ids[:num_tokens])


def zipf_choices(rng: random.Random, n: int, s: float, k: int) -> list[int]:
    weights = [1 / (rank + 1) ** s for rank in range(n)]
    return rng.choices(range(n), weights=weights, k=k)


def one_request(client, template: str, text: str, max_new_tokens: int) -> tuple[int, int, float]:
    """Streams one request: (prompt tokens, cached prompt tokens, client-side time to first token)."""
    request = client.request(text, template=template, max_new_tokens=max_new_tokens, ignore_eos=True)
    start = time.perf_counter()
    ttft, usage = None, None
    for message in client.stub.Generate(request, timeout=600):
        if ttft is None and message.token_ids:
            ttft = time.perf_counter() - start
        if message.HasField("usage"):
            usage = message.usage
    assert usage is not None and ttft is not None
    return usage.prompt_tokens, usage.cached_prompt_tokens, ttft


def run_variant(folder: Path, engines, gateway_args, templates, requests, args) -> dict[str, Any]:
    """One gateway in front of ``engines``: create the templates, run the requests, delete them."""
    from gateway.client import GatewayClient

    folder.mkdir()
    with (
        harness.GatewayProcess(folder, ",".join(engines), gateway_args) as gateway,
        GatewayClient(gateway.address, timeout_s=600) as client,
        ThreadPoolExecutor(args.concurrency) as pool,
    ):
        deadline = time.monotonic() + 60
        while sum(r.serving for r in client.info().replicas) < len(engines) and time.monotonic() < deadline:
            time.sleep(0.2)
        for i, text in enumerate(templates):
            client.create_template(f"tpl-{i}", text)
        placed = {r.address: r.templates for r in client.info().replicas}
        progress = harness.Progress(f"routing: {folder.name}", len(requests))

        def send(item: tuple[int, str]):
            out = one_request(client, f"tpl-{item[0]}", item[1], args.max_new_tokens)
            progress.advance()
            return out

        start = time.perf_counter()
        rows = list(pool.map(send, requests))
        wall_s = time.perf_counter() - start
        progress.done()
        for i in range(len(templates)):
            client.delete_template(f"tpl-{i}")
    prompt_tokens = sum(r[0] for r in rows)
    return {
        "requests": len(rows),
        "cached_token_ratio": sum(r[1] for r in rows) / prompt_tokens,
        "ttft_mean_s": harness.mean([r[2] for r in rows]),
        "ttft_p90_s": harness.percentile([r[2] for r in rows], 90),
        "wall_s": wall_s,
        "templates_pinned_by_replica": list(placed.values()),
    }


def median_run(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """A variant's rounds as one: the median of each figure, every round's TTFT and hit ratio kept."""
    out = dict(rows[-1])
    for k in ("cached_token_ratio", "ttft_mean_s", "ttft_p90_s", "wall_s"):
        out[k] = statistics.median(r[k] for r in rows)
    out["rounds"] = [{"cached_token_ratio": r["cached_token_ratio"], "ttft_mean_s": r["ttft_mean_s"]} for r in rows]
    return out


def reset(daemons) -> None:
    from kvd.common.client import DaemonClient
    from kvd_api.daemon.v1 import daemon_pb2 as dpb

    for kvd in daemons:
        with DaemonClient.connect(kvd.address) as client:
            client.stub.Reset(dpb.ResetRequest())


def routing_overhead(tokenizer, rng: random.Random) -> dict[str, float]:
    """What cost or affinity routing adds to a plain-text request in the
    gateway: tokenizing it (the gateway's own tokenizer, no round trip) and
    hashing its blocks (medians over 50, 300-token prompts)."""
    from kvd.common.hashing import encode_extra_keys, hash_token_ids

    texts = [words(rng, tokenizer, 300) for _ in range(50)]
    tokenize_s, hash_s = [], []
    for text in texts:
        start = time.perf_counter()
        ids = tokenizer.encode(text, add_special_tokens=False)
        tokenize_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        hash_token_ids(ids, BLOCK, encode_extra_keys(b"tenant-salt-0123"))
        hash_s.append(time.perf_counter() - start)
    return {"tokenize_ms": 1e3 * statistics.median(tokenize_s), "hash_blocks_ms": 1e3 * statistics.median(hash_s)}


def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    from inference import model_store

    n = args.requests or (40 if args.quick else 200)
    template_len = args.template_tokens or (128 if args.quick else 256)
    template_blocks = template_len // BLOCK
    # One replica's pool: as many blocks as all the templates together, so it
    # holds its half of them and its requests' blocks, but never all of them.
    per_replica = args.templates * template_blocks
    pin_fraction = 0.6  # room for more than half the templates: a skewed placement still fits
    model_dir = model_store.resolve_model(args.model, model_store.default_cache_dir())
    tokenizer = model_store.load_tokenizer(model_dir)
    rng = random.Random(args.seed)
    templates = [f"Template {i}. " + words(rng, tokenizer, template_len) for i in range(args.templates)]
    choices = zipf_choices(rng, args.templates, args.zipf_s, n)
    requests = [(t, f" Request {j}: " + words(rng, tokenizer, args.prompt_tokens)) for j, t in enumerate(choices)]

    def daemon(name: str, blocks: int) -> harness.DaemonProcess:
        flags = ["--block-size", str(BLOCK), "--num-blocks", str(blocks), "--metrics-port", "0",
                 "--max-pinned-fraction", str(pin_fraction)]  # fmt: skip
        return harness.DaemonProcess(workdir, flags, name=name)

    engine_args = ["--model", str(model_dir)]
    with (
        daemon("kvd-a", per_replica) as kvd_a,
        daemon("kvd-b", per_replica) as kvd_b,
        daemon("kvd-single", 2 * per_replica) as kvd_s,
        harness.EngineProcess(workdir, kvd_a.address, engine_args, name="engine-a") as engine_a,
        harness.EngineProcess(workdir, kvd_b.address, engine_args, name="engine-b") as engine_b,
        harness.EngineProcess(workdir, kvd_s.address, engine_args, name="engine-single") as engine_s,
    ):
        pair = [engine_a.address, engine_b.address]
        variants = [
            ("round_robin", pair, ["--routing", "round-robin"]),
            ("affinity", pair, ["--routing", "affinity"]),
            ("cost", pair, ["--routing", "cost"]),
            ("single", [engine_s.address], []),
        ]
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in variants}
        for turn in range(args.rounds):
            for name, engines, gateway_args in harness.turn_order(variants, turn):
                folder = workdir / f"{name}-{turn}"
                runs[name].append(run_variant(folder, engines, gateway_args, templates, requests, args))
                reset([kvd_a, kvd_b, kvd_s])
        results = {name: median_run(rows) for name, rows in runs.items()}
        results["routing_overhead"] = routing_overhead(tokenizer, rng)
    counts = [choices.count(i) for i in range(args.templates)]
    workload = {
        "replicas": 2,
        "requests": n,
        "templates": args.templates,
        "template_tokens": len(tokenizer.encode(templates[0], add_special_tokens=False)),
        "prompt_tokens": args.prompt_tokens,
        "max_new_tokens": args.max_new_tokens,
        "concurrency": args.concurrency,
        "zipf_s": args.zipf_s,
        "requests_per_template": counts,
        "seed": args.seed,
        "model": model_dir.name,
        "dtype": "float32",
        "block_size": BLOCK,
        "blocks_per_replica": per_replica,
        "blocks_single": 2 * per_replica,
        "max_pinned_fraction": pin_fraction,
        "pool_note": (
            "each replica's pool has as many blocks as all templates together: it holds its half of the "
            "templates plus its requests' blocks, so a round-robin split, which wants every template on both "
            "replicas, evicts the cold templates' copies; the single replica has both pools' blocks"
        ),
        "rounds": args.rounds,
        "order": "round_robin, affinity, cost, single, then backward, alternating by round; templates deleted "
        "and daemons reset between variants; figures are medians over the rounds",
        "ttft": "client-side, to the first message with tokens, through the gateway",
    }
    return {"workload": workload, "results": results}


def report(args: argparse.Namespace, out: dict[str, Any]) -> dict[str, Any]:
    results = out["results"]
    ratios = {
        "affinity_over_single_hit": harness.ratio(
            results["affinity"]["cached_token_ratio"], results["single"]["cached_token_ratio"]
        ),
        "affinity_over_round_robin_ttft": harness.ratio(
            results["affinity"]["ttft_mean_s"], results["round_robin"]["ttft_mean_s"]
        ),
        "cost_over_single_hit": harness.ratio(
            results["cost"]["cached_token_ratio"], results["single"]["cached_token_ratio"]
        ),
        "cost_over_round_robin_ttft": harness.ratio(
            results["cost"]["ttft_mean_s"], results["round_robin"]["ttft_mean_s"]
        ),
        "round_robin_over_single_hit": harness.ratio(
            results["round_robin"]["cached_token_ratio"], results["single"]["cached_token_ratio"]
        ),
    }
    return harness.stack_report(
        "routing", args.quick, out["workload"], harness.rounded(results), harness.rounded(ratios)
    )


def table(report: dict[str, Any]) -> str:
    results, ratios = report["results"], report["ratios"]
    rows = [
        [v, r["requests"], r["cached_token_ratio"], r["ttft_mean_s"], r["ttft_p90_s"], r["wall_s"]]
        for v, r in results.items()
        if v != "routing_overhead"
    ]
    lines = [harness.format_table(["variant", "requests", "cached", "ttft mean s", "ttft p90 s", "wall s"], rows)]
    for policy in ("affinity", "cost"):
        hit, ttft = ratios[f"{policy}_over_single_hit"], ratios[f"{policy}_over_round_robin_ttft"]
        lines.append(
            f"{policy} keeps {hit:.1%} of the single replica's cached-token ratio (target >= 90%); "
            f"its mean TTFT is {ttft:.2f}x round-robin's (target < 1)"
        )
    overhead = results["routing_overhead"]
    lines.append(f"routing overhead on a plain-text prompt in the gateway: tokenize {overhead['tokenize_ms']:.2f}"
                 f" ms, hash {overhead['hash_blocks_ms']:.3f} ms")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return harness.main(parse_args(argv), measure=run, report=report, table=table)


if __name__ == "__main__":
    sys.exit(main())
