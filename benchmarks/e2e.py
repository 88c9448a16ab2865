"""End-to-end benchmark: a shared-prefix workload through four ways of serving it.

SmolLM2-135M-Instruct, float32, on the CPU (``--device cuda`` with a model
folder: the GPU run, see benchmarks/gpu_e2e.sh). The workload (seeded, real text):
16 requests, each one ~600-token document prefix (the same for all) + a
distinct ~40-token question, 32 greedy new tokens (EOS disabled), all
submitted at once (t = 0). Four variants, side by side in one run:

    hf_generate             transformers' ``model.generate``, one request at a time;
    hf_continuous_batching  transformers' own continuous batching (the manager
                            behind ``generate_batch``: paged cache, prefix
                            sharing on), in this process;
    kvd_no_cache            a kvd daemon + engine subprocess, prefix caching off;
    kvd                     the same with prefix caching on.

Each reports total seconds (t = 0 to the last request's last token), output
tokens/s, mean and p90 time to first token (from t = 0, so queueing counts)
and the cached share of prompt tokens. hf_generate runs once; the other three
take turns for ``--rounds`` rounds (default 3) and report medians, since this
machine's speed drifts by 10-20% from one minute to the next. Then, on the
``kvd`` engine, the time to first token of a request whose 1,000-token prefix
is cold, then warm (same prefix, another suffix), for a few distinct prefixes
(medians).

Every variant gets one short warm-up request first (not timed, sharing no
prefix with the workload). The greedy outputs of every variant are compared
with ``hf_generate``'s (``tokens_match_hf_generate``).

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/e2e.py --json FILE [--quick] [--plot FILE]

This file runs them in turn and writes the report and its table; the workload
is in e2e_workload.py, the transformers baselines in e2e_hf.py, the kvd
variants in e2e_engines.py, and what all benchmarks share in harness/.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import shutil
import sys
import time
import traceback
from pathlib import Path
from typing import Any

# NOTE: before torch loads OpenMP: the transformers baselines run in this
# process with the OpenMP settings the engine's processes get (inference/openmp.py).
from inference import openmp  # noqa: E402

openmp.set_defaults()

import harness  # noqa: E402
import torch  # noqa: E402
from e2e_engines import EngineVariant  # noqa: E402
from e2e_hf import run_hf_continuous_batching, run_hf_generate  # noqa: E402
from e2e_workload import BLOCK_SIZE, METRICS, Run, Workload, build_workload, combine_rounds  # noqa: E402

from inference import model_store  # noqa: E402
from kvd.common.defaults import TOKEN_BUDGET  # noqa: E402

VARIANTS = ("hf_generate", "hf_continuous_batching", "kvd_no_cache", "kvd")
ENGINE_VARIANTS = ("kvd_no_cache", "kvd")
FULL = {
    "requests": 16,
    "prefix_tokens": 600,
    "question_tokens": 40,
    "new_tokens": 32,
    "warm_cold_prefix_tokens": 1000,
    "warm_cold_suffix_tokens": 16,
    "warm_cold_new_tokens": 4,
    "warm_cold_repeats": 3,
}
#: The GPU's larger workload (benchmarks/gpu_e2e.sh OUT TOKENIZER --workload large).
LARGE = {
    "requests": 256,
    "prefix_tokens": 2000,
    "question_tokens": 100,
    "new_tokens": 128,
    "warm_cold_prefix_tokens": 2000,
    "warm_cold_suffix_tokens": 100,
    "warm_cold_new_tokens": 4,
    "warm_cold_repeats": 3,
}
WORKLOADS = {"default": FULL, "large": LARGE}
QUICK = {
    "requests": 4,
    "prefix_tokens": 200,
    "question_tokens": 40,
    "new_tokens": 8,
    "warm_cold_prefix_tokens": 500,
    "warm_cold_suffix_tokens": 16,
    "warm_cold_new_tokens": 2,
    "warm_cold_repeats": 1,
}


# ------------------------------------------------------------------ report


def agreement(tokens: list[list[int]], reference: list[list[int]]) -> dict[str, float]:
    """Greedy outputs against hf_generate's: identical requests, and the mean
    share of each output before its first differing token."""
    same, shares = 0, []
    for a, b in zip(tokens, reference, strict=True):
        same += a == b
        n = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        shares.append(n / max(1, len(b)))
    return {"tokens_match_hf_generate": same / len(reference), "matching_prefix_share": harness.mean(shares)}


def build_ratios(results: dict[str, Any]) -> dict[str, float | None]:
    def get(variant: str, metric: str) -> float | None:
        return (results.get(variant) or {}).get(metric)

    warm_cold = results.get("warm_cold") or {}
    return {
        "throughput_vs_hf_cb": harness.ratio(
            get("kvd", "output_tokens_per_s"), get("hf_continuous_batching", "output_tokens_per_s")
        ),
        "ttft_vs_hf_cb": harness.ratio(get("kvd", "ttft_mean_s"), get("hf_continuous_batching", "ttft_mean_s")),
        "warm_over_cold": harness.ratio(warm_cold.get("ttft_warm_s"), warm_cold.get("ttft_cold_s")),
        "throughput_vs_hf_generate": harness.ratio(
            get("kvd", "output_tokens_per_s"), get("hf_generate", "output_tokens_per_s")
        ),
        "throughput_vs_kvd_no_cache": harness.ratio(
            get("kvd", "output_tokens_per_s"), get("kvd_no_cache", "output_tokens_per_s")
        ),
        "ttft_vs_kvd_no_cache": harness.ratio(get("kvd", "ttft_mean_s"), get("kvd_no_cache", "ttft_mean_s")),
        "hf_cb_throughput_vs_hf_generate": harness.ratio(
            get("hf_continuous_batching", "output_tokens_per_s"), get("hf_generate", "output_tokens_per_s")
        ),
    }


def paired_ratios(results: dict[str, Any]) -> dict[str, list[float]]:
    """The target ratios of each round on its own (kvd against the
    continuous batching run just before it)."""
    cb = (results.get("hf_continuous_batching") or {}).get("rounds") or []
    kvd = (results.get("kvd") or {}).get("rounds") or []
    if not cb or len(cb) != len(kvd):
        return {}
    pairs = list(zip(kvd, cb, strict=True))
    return {
        "throughput_vs_hf_cb": [k["output_tokens_per_s"] / c["output_tokens_per_s"] for k, c in pairs],
        "ttft_vs_hf_cb": [k["ttft_mean_s"] / c["ttft_mean_s"] for k, c in pairs],
    }


TARGETS = {
    "throughput_vs_hf_cb": (">=", 3.0),
    "ttft_vs_hf_cb": ("<=", 0.3),
    "warm_over_cold": ("<=", 0.15),
}


def check_targets(ratios: dict[str, float | None]) -> dict[str, Any]:
    out = {}
    for name, (op, bound) in TARGETS.items():
        value = ratios.get(name)
        met = None if value is None else (value >= bound if op == ">=" else value <= bound)
        out[name] = {"target": f"{op} {bound}", "value": value, "met": met}
    return out


def table(report: dict[str, Any]) -> str:
    results, ratios, targets = report["results"], report["ratios"], report["targets"]
    rows = []
    for v in VARIANTS:
        r = results.get(v)
        if r is None:
            continue
        if "error" in r:
            rows.append([v, *([None] * 6), "ERROR: " + r["error"].splitlines()[0][:60]])
            continue
        match = r.get("tokens_match_hf_generate")
        rows.append(
            [
                v,
                r["total_s"],
                r["output_tokens_per_s"],
                r["ttft_mean_s"],
                r["ttft_p90_s"],
                r["cached_token_ratio"],
                match,
                "",
            ]
        )
    headers = ["variant", "total s", "out tok/s", "TTFT mean s", "TTFT p90 s", "cached", "same as hf_generate", ""]
    lines = [harness.format_table(headers, rows), ""]
    wc = results.get("warm_cold") or {}
    if "error" in wc:
        lines.append(f"warm/cold: ERROR: {wc['error'].splitlines()[0]}")
    elif wc:
        lines.append(
            harness.format_table(
                ["warm/cold", "prefix tokens", "TTFT cold s", "TTFT warm s", "repeats"],
                [["kvd", wc["prefix_tokens"], wc["ttft_cold_s"], wc["ttft_warm_s"], wc["repeats"]]],
            )
        )
    lines.append("")
    rows = []
    for name, value in ratios.items():
        t = targets.get(name)
        met = "" if t is None else f"target {t['target']}: " + {True: "met", False: "NOT met", None: "-"}[t["met"]]
        rows.append([name, value, met])
    lines.append(harness.format_table(["ratio", "value", ""], rows))
    return "\n".join(lines)


# ------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = harness.parser(__doc__, quick_help="4 requests, 200-token prefix, 8 new tokens (about a minute)")
    p.add_argument(
        "--workload",
        choices=sorted(WORKLOADS),
        default="default",
        help="default: 16 requests, 600-token prefix, 32 new tokens; large (the GPU's): 256 requests, "
        "2,000-token prefix, ~100-token questions, 128 new tokens (--quick wins over it)",
    )
    p.add_argument(
        "--token-budget",
        type=int,
        default=TOKEN_BUDGET,
        help="the engine's tokens per step and continuous batching's max_batch_tokens",
    )
    p.add_argument("--max-num-seqs", type=int, default=64, help="the engine's running sequences")
    p.add_argument(
        "--num-blocks",
        type=int,
        default=0,
        help="KV blocks of each engine and of continuous batching (default: every request's whole sequence "
        "twice over, no sharing counted; the large workload on a GPU needs less: its prefix is shared)",
    )
    p.add_argument("--plot", help="also write a PNG bar chart (needs matplotlib)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--logs", help="copy the daemons' and engines' logs into this folder")
    p.add_argument("--model", default="smollm2", help="'smollm2' or a local Hugging Face folder")
    p.add_argument("--device", default="cpu", help="cpu or cuda: the daemon's cache, the engine and the hf baselines")
    p.add_argument("--dtype", default="", help="default: float32 on cpu, bfloat16 on cuda")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset to run (default: all four)")
    p.add_argument(
        "--rounds",
        type=int,
        default=0,
        help="rounds of every variant but hf_generate, taking turns (default 3; --quick: 1)",
    )
    return p.parse_args(argv)


def variant_results(runs: list[Run], reference: Run | None, new_tokens: int) -> dict[str, Any]:
    """A variant's medians over its rounds, and its worst round's agreement with ``hf_generate``."""
    results = combine_rounds(runs)
    results["all_outputs_full_length"] = all(len(t) == new_tokens for run in runs for t in run.tokens)
    if reference is not None:
        shares = [agreement(run.tokens, reference.tokens) for run in runs]
        results.update(min(shares, key=lambda a: (a["tokens_match_hf_generate"], a["matching_prefix_share"])))
    return results


@dataclasses.dataclass
class Measured:
    """What a run has measured so far: the report is written from it after
    every piece of work, and once more at the end."""

    chosen: list[str]
    dtype: str
    sizes: dict[str, int]
    model_path: Path
    w: Workload
    num_blocks: int
    rounds: int
    started: float
    code: dict[str, Any] = dataclasses.field(default_factory=dict)
    results: dict[str, Any] = dataclasses.field(default_factory=dict)  # the warm/cold figures, once measured
    runs: dict[str, list[Run]] = dataclasses.field(default_factory=dict)
    failed: dict[str, str] = dataclasses.field(default_factory=dict)
    launched: list[dict[str, Any]] = dataclasses.field(default_factory=list)


def measure(args: argparse.Namespace, workdir: Path) -> Measured:
    """hf_generate once, then the other variants round after round, then kvd's warm/cold."""
    dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    sizes = dict(QUICK if args.quick else WORKLOADS[args.workload])
    chosen = [v for v in VARIANTS if v in args.variants.split(",")]
    started = time.perf_counter()

    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)  # its "EOS disabled" warning is intended
    model_path = model_store.resolve_model(args.model, model_store.default_cache_dir())
    tokenizer = model_store.load_tokenizer(model_path)
    w = build_workload(tokenizer, sizes, args.seed)
    per_request_blocks = -(-(max(len(p) for p in w.prompts) + sizes["new_tokens"]) // BLOCK_SIZE)
    wc_blocks = -(-(sizes["warm_cold_prefix_tokens"] + sizes["warm_cold_suffix_tokens"] + 8) // BLOCK_SIZE)
    needed = len(w.prompts) * per_request_blocks + 2 * len(w.warm_cold) * wc_blocks + 16
    num_blocks = args.num_blocks or 256 * -(-(2 * needed) // 256)  # room for everything twice over: no eviction
    m = Measured(chosen, dtype, sizes, model_path, w, num_blocks, args.rounds or (1 if args.quick else 3), started)
    model = None
    if "hf_generate" in chosen or "hf_continuous_batching" in chosen:
        model = model_store.load_model(model_path, getattr(torch, dtype), args.device)
    engines = {
        v: EngineVariant(
            v, model_path, num_blocks, v == "kvd", str(workdir), args.device, dtype, args.token_budget,
            args.max_num_seqs,
        )
        for v in chosen
        if v in ENGINE_VARIANTS
    }  # fmt: skip

    def attempt(variant: str, work) -> Any:
        """Runs one piece of a variant's work; a failure is reported, the others
        go on. The JSON is rewritten after each piece (a run cut short keeps them)."""
        if variant in m.failed:
            return None
        try:
            return work()
        except Exception as exc:
            harness.log(f"{variant} FAILED:\n{traceback.format_exc()}")
            logs = engines[variant].logs() if variant in engines else ""
            m.failed[variant] = f"{type(exc).__name__}: {exc}\n{logs}".strip()
            return None
        finally:
            harness.write_json(args.json, report(args, m, complete=False))

    m.code = harness.source_digest(
        ("kvd/**/*.py", "inference/**/*.py", "protos/**/*.proto", "benchmarks/e2e*.py", "benchmarks/harness/*.py")
    )
    try:
        if "hf_generate" in chosen:  # the reference outputs; once (the slowest, and in no target)
            run = attempt("hf_generate", lambda: run_hf_generate(model, w, sizes["new_tokens"]))
            m.runs["hf_generate"] = [run] if run is not None else []
        for variant, engine in engines.items():
            info = attempt(variant, lambda engine=engine: engine.start(w.warmup))
            if info is not None:
                m.launched.append(info)
        # The variants in targets take turns, round after round, so a slow
        # spell of this shared machine falls on all of them alike.
        for r in range(m.rounds):
            for variant in chosen:
                if variant == "hf_generate":
                    continue
                if variant == "hf_continuous_batching":
                    work = lambda: run_hf_continuous_batching(  # noqa: E731
                        model, w, sizes["new_tokens"], num_blocks, args.token_budget
                    )
                else:
                    work = lambda engine=engines[variant], r=r: engine.run(w, sizes["new_tokens"], r)  # noqa: E731
                run = attempt(variant, work)
                if run is not None:
                    m.runs.setdefault(variant, []).append(run)
        if "kvd" in engines:
            warm_cold = attempt("kvd", lambda: engines["kvd"].warm_cold(w, sizes["warm_cold_new_tokens"]))
            if warm_cold is not None:
                m.results["warm_cold"] = warm_cold
    finally:
        for engine in engines.values():
            engine.stop()
        if args.logs:
            for log_file in workdir.glob("*/*.log"):
                target = Path(args.logs) / f"{log_file.parent.name}-{log_file.name}"
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(log_file, target)
    return m


def report(args: argparse.Namespace, m: Measured, complete: bool = True) -> dict[str, Any]:
    """The JSON of what has run so far (each variant's rounds to date)."""
    import transformers

    measured = dict(m.results)
    reference = (m.runs.get("hf_generate") or [None])[0]
    for variant in m.chosen:
        if variant in m.failed:
            measured[variant] = {**dict.fromkeys(METRICS), "error": m.failed[variant]}
        elif m.runs.get(variant):
            measured[variant] = variant_results(m.runs[variant], reference, m.sizes["new_tokens"])
    if "kvd" in m.failed:
        measured["warm_cold"] = {"ttft_cold_s": None, "ttft_warm_s": None, "error": "the kvd variant failed"}
    ratios = build_ratios(measured)
    hf_cb_params = {
        "api": "model.init_continuous_batching + warmup + start + add_requests (what generate_batch runs)",
        "page_size": BLOCK_SIZE,
        "num_blocks": m.num_blocks,
        "max_batch_tokens": args.token_budget,
        "allow_block_sharing": True,
        "attn_implementation": (measured.get("hf_continuous_batching") or {}).get("attn_implementation"),
    }
    return {
        "benchmark": "e2e",
        "quick": args.quick,
        "complete": complete,
        "machine": {
            **harness.machine_info(),
            "torch_threads": torch.get_num_threads(),
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
            "gomp_spincount": os.environ.get("GOMP_SPINCOUNT"),
            **({"gpu": torch.cuda.get_device_name()} if args.device.startswith("cuda") else {}),
        },
        "code": m.code,
        "workload": {
            **m.w.params,
            "model": args.model,
            "model_path": str(m.model_path),
            "dtype": m.dtype,
            "device": args.device,
            "transformers": transformers.__version__,
            "greedy": True,
            "eos": "disabled (eos_token_id=None / ignore_eos)",
            "variants": m.chosen,
            "block_size": BLOCK_SIZE,
            "kvd_num_blocks": m.num_blocks,
            "kvd_token_budget": args.token_budget,
            "kvd_max_num_seqs": args.max_num_seqs,
            "workload": "quick" if args.quick else args.workload,
            "kvd_no_cache": "engine --no-prefix-caching (every request gets a cache salt of its own)",
            "hf_continuous_batching": hf_cb_params,
            "hf_generate": "model.generate per request, in order; attention_mask all ones, min/max_new_tokens",
            "submission": "all requests at t = 0 (engines: one client thread per request, released together)",
            "timing": {
                "total_s": "t = 0 to the last request's last token (as the client received it)",
                "ttft": "t = 0 to the first new token: hf_generate: a streamer's put() right after the first "
                "token is sampled (so request i waits for 0..i-1); hf_continuous_batching: the manager's "
                "per-token timestamp (record_timestamps); engines: first streamed gRPC message with tokens",
                "warm_cold": "one request at a time on the idle kvd engine; TTFT from its submission; medians",
            },
            "warmup": "one short request per variant, not timed, sharing no prefix with the workload",
            "rounds": m.rounds,
            "rounds_order": "hf_generate once; then per round hf_continuous_batching, kvd_no_cache, kvd in "
            "turn (engines stay up; each round its own cache salt, so it starts cold); reported metrics are "
            "medians over rounds",
            "engines": m.launched,
        },
        "results": harness.rounded(measured),
        "ratios": harness.rounded(ratios),
        "ratios_per_round": harness.rounded(paired_ratios(measured)),
        "targets": harness.rounded(check_targets(ratios)),
        "total_s": round(time.perf_counter() - m.started, 1),
    }


def verdict(args: argparse.Namespace, report: dict[str, Any]) -> int:
    """1 when a variant failed; the plot first, if asked for."""
    results, chosen = report["results"], report["workload"]["variants"]
    failed = [v for v in chosen if "error" in results.get(v, {})]
    shown = [v for v in chosen if v not in failed]
    if args.plot and "hf_generate" in shown:
        series = {
            "output tokens/s": [
                results[v]["output_tokens_per_s"] / results["hf_generate"]["output_tokens_per_s"] for v in shown
            ],
            "mean TTFT": [results[v]["ttft_mean_s"] / results["hf_generate"]["ttft_mean_s"] for v in shown],
        }
        if harness.bar_chart(
            args.plot, shown, series, "x hf_generate", f"e2e shared-prefix workload ({args.model}, {args.device})"
        ):
            harness.log(f"plot written to {args.plot}")
    harness.log(f"results written to {args.json} in {report['total_s']}s")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return harness.main(
        args,
        measure=measure,
        report=report,
        table=table,
        verdict=verdict,
        workdir_prefix="kvd-e2e-",
    )


if __name__ == "__main__":
    sys.exit(main())
