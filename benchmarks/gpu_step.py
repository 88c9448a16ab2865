"""The engine's decode step on a GPU against the physical floor, and the
Triton attention kernels against gathering K/V and running SDPA.

In one process, on the random-weight Llama of tests/gpu/random_llama.py
(bfloat16, block size 16, the triton backend):

- ``floor``: the read bandwidth measured by a reduction over a 2 GB buffer,
  the weight bytes a decode step reads (every parameter but the embedding
  table, of which it reads a row per token), and per case the floor
  ``(weight bytes + K/V bytes read) / bandwidth``;
- ``decode``: batch 1, 16, 64, 256 at context ~700 and ~2,000, every
  sequence sharing its prompt's blocks (``shared``) or not (``distinct``):
  GPU busy time per decode step (the sum of its kernels' times, from the
  profiler), engine wall time per step (``ModelRunner.forward`` + sampling,
  host included) and the blocking syncs per step (``set_sync_debug_mode``),
  on the engine's path (the step replays its bucket's CUDA graph) and, as
  ``*_eager_s``, with every kernel launched from Python; ``mode`` says
  which the unsuffixed figures are (``eager`` when the capture failed:
  ``capture_error`` says why); ``gpu_elapsed_step_s`` is the same steps
  timed by CUDA events, a check on the profiler's sum (which could miss
  the kernels of a graph); ``kernels_per_step`` and
  ``top_kernels_us_per_step`` (the six costliest kernels) say where the
  busy time goes;
- ``capture``: what the engine's capture at attach costs with its default
  settings (64 sequences, a 512-token budget): seconds, graphs, device bytes;
- ``attention``: one layer's Triton paged attention against gathering the
  K/V through the block table and running SDPA (``enable_gqa``, flash
  backend where it takes the inputs) for decodes at context 2,000 (batch
  16, 64) and a 512-token prefill chunk over 2,000 cached positions:
  microseconds (medians of ``triton.testing.do_bench``) and K/V GB/s.

    python3 benchmarks/gpu_step.py --json FILE [--quick]

The model is ``$KVD_GPU_MODEL`` when that folder holds one (tests/gpu/run.sh
builds it once), else built here on the GPU. The JSON is rewritten after
each case, so a run cut short keeps what it measured. Without CUDA it says
so and exits with status 2, measuring nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[1:1] = [str(ROOT), str(ROOT / "protos")]

import harness  # noqa: E402
import torch  # noqa: E402

# NOTE: a ratio's meaning, where it could be read either way: triton_over_sdpa_*
# is SDPA-on-gathered time / Triton time (> 1: Triton is faster);
# eager_over_graphed_wall_b16 is eager wall time / graphed wall time (> 1: graphs are faster).

BLOCK = 16
BATCHES = (1, 16, 64, 256)
CONTEXTS = {"ctx700": 700, "ctx2000": 2000}


def read_bandwidth(gigabytes: float = 2.0) -> float:
    """Bytes per second of a sum over a buffer far larger than the L2 (median of 20)."""
    import triton.testing

    buffer = torch.randn(int(gigabytes * 2**30) // 2, dtype=torch.bfloat16, device="cuda")
    seconds = (
        triton.testing.do_bench(lambda: buffer.sum(dtype=torch.float32), warmup=50, rep=400, return_mode="median") / 1e3
    )
    return buffer.numel() * buffer.element_size() / seconds


def new_cache(model, num_blocks: int) -> torch.Tensor:
    c = model.config
    head_dim = c.hidden_size // c.num_attention_heads
    shape = (num_blocks, c.num_hidden_layers, 2, BLOCK, c.num_key_value_heads, head_dim)
    return torch.randn(shape, dtype=torch.bfloat16, device="cuda")


def decode_case(model, batch: int, context: int, shared: bool) -> tuple[list, torch.Tensor, int]:
    """One decode step's chunks at position ``context`` for ``batch`` sequences,
    a cache (random K/V) and the K/V bytes the step reads."""
    from inference.step_inputs import Chunk

    blocks_per_seq = -(-(context + 1) // BLOCK)
    prefix = (context // BLOCK) if shared else 0  # full blocks every sequence shares
    own = blocks_per_seq - prefix
    # At least a whole context's blocks: the graphs size their block table and
    # split counts by the model's context, as on the engine's (larger) pool.
    num_blocks = max(prefix + batch * own, -(-model.config.max_position_embeddings // BLOCK))
    c = model.config
    head_dim = c.hidden_size // c.num_attention_heads
    cache = new_cache(model, num_blocks)
    order = torch.randperm(num_blocks).tolist()
    shared_blocks = order[:prefix]
    chunks = []
    for i in range(batch):
        own_blocks = order[prefix + i * own : prefix + (i + 1) * own]
        chunks.append(Chunk([11 + i], context, shared_blocks + own_blocks, context, True, f"r{i}"))
    per_token = c.num_hidden_layers * 2 * c.num_key_value_heads * head_dim * 2
    return chunks, cache, batch * (context + 1) * per_token


#: time_steps' figures as the eager columns of a decode case.
EAGER_COLUMNS = {
    "gpu_step_s": "gpu_step_eager_s",
    "gpu_elapsed_step_s": "gpu_elapsed_step_eager_s",
    "wall_step_s": "wall_step_eager_s",
    "blocking_syncs_per_step": "blocking_syncs_per_step_eager",
    "kernels_per_step": "kernels_per_step_eager",
    "top_kernels_us_per_step": "top_kernels_us_per_step_eager",
}


def time_decode(model, chunks, cache, steps: int) -> dict[str, Any]:
    """The step eagerly, then on the engine's path: its bucket's graph
    captured as the engine captures it (split count for the model's context).
    A failed capture keeps the eager figures (``mode: eager``)."""
    from inference.cuda_graphs import CudaGraphCapture, GraphPlan, capture_graphs
    from inference.model_runner import ModelRunner

    runner = ModelRunner(model, cache, BLOCK)
    eager = time_steps(runner, chunks, steps)
    batch = len(chunks)
    plan = GraphPlan((batch,), (), batch, model.config.max_position_embeddings)
    with capture_errors() as errors:
        runner.graphs = capture_graphs(runner, plan, CudaGraphCapture(runner.device))
    eager_columns = {EAGER_COLUMNS[key]: value for key, value in eager.items()}
    if runner.graphs is None:
        return {**eager, **eager_columns, "mode": "eager", "capture_error": errors[-1] if errors else "unknown"}
    graphed = time_steps(runner, chunks, steps)
    assert runner.graphs.replays >= steps, "the decode step did not replay its graph"
    return {**graphed, **eager_columns, "mode": "graphed"}


@contextlib.contextmanager
def capture_errors() -> Iterator[list[str]]:
    """Collects what the engine's capture logs when it fails (it logs and runs eagerly)."""
    found: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.ERROR:
                found.append(self.format(record))

    handler = Keep()
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger = logging.getLogger("inference.cuda_graphs")
    logger.addHandler(handler)
    try:
        yield found
    finally:
        logger.removeHandler(handler)


def time_steps(runner, chunks, steps: int) -> dict[str, float]:
    """GPU busy time (profiler) and elapsed time (CUDA events), wall time
    and blocking syncs of forward + sampling."""
    from inference.sampling import Sampler, SamplingParams

    sampler = Sampler()
    params, generators = [SamplingParams()] * len(chunks), [None] * len(chunks)

    def step():
        return sampler.sample(runner.forward(chunks), params, generators)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start = time.perf_counter()
    begin.record()
    for _ in range(steps):
        step()
    end.record()
    wall = (time.perf_counter() - start) / steps
    end.synchronize()
    elapsed = begin.elapsed_time(end) / 1e3 / steps
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    busy_us = sum(e.self_device_time_total for e in kernels)
    # Where the busy time goes: at small batches a decode is many short
    # kernels, not one weight read, so the count says as much as the bytes.
    top = sorted(kernels, key=lambda e: e.self_device_time_total, reverse=True)[:6]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = sum("synchroniz" in str(w.message) for w in caught)
    return {"gpu_step_s": busy_us / 1e6 / steps, "gpu_elapsed_step_s": elapsed, "wall_step_s": wall,
            "blocking_syncs_per_step": syncs, "kernels_per_step": sum(e.count for e in kernels) / steps,
            "top_kernels_us_per_step": {e.key[:80]: e.self_device_time_total / steps for e in top}}  # fmt: skip


def time_capture(model) -> dict[str, float]:
    """The engine's capture at attach with its default settings."""
    from inference.config import EngineConfig
    from inference.cuda_graphs import CudaGraphCapture, GraphPlan, capture_graphs
    from inference.model_runner import ModelRunner

    c = EngineConfig()
    context = model.config.max_position_embeddings
    runner = ModelRunner(model, new_cache(model, 2 * -(-context // BLOCK)), BLOCK)
    plan = GraphPlan.for_engine(c.max_num_seqs, c.token_budget, context)
    with capture_errors() as errors:
        graphs = capture_graphs(runner, plan, CudaGraphCapture(runner.device))
    if graphs is None:
        return {"capture_error": errors[-1] if errors else "unknown"}
    return {"capture_s": graphs.capture_s, "graphs": len(graphs.buckets), "capture_bytes": graphs.capture_bytes,
            "max_num_seqs": c.max_num_seqs, "token_budget": c.token_budget}  # fmt: skip


def time_attention(batch: int, q_len: int, context: int, kv_heads: int = 8, group: int = 4, head_dim: int = 128):
    """One layer: the Triton kernel vs gather + SDPA, for ``batch`` sequences
    of ``q_len`` queries ending at position ``context``."""
    import torch.nn.functional as F
    import triton.testing
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from inference.kernels.launch import LaunchShape, choose_splits
    from inference.kernels.paged_attention import paged_attention

    width = -(-context // BLOCK)
    num_blocks = batch * width
    cache = torch.randn(num_blocks, 1, 2, BLOCK, kv_heads, head_dim, dtype=torch.bfloat16, device="cuda")
    layer_k, layer_v = cache[:, 0, 0], cache[:, 0, 1]
    table = torch.randperm(num_blocks, device="cuda").view(batch, width).to(torch.int32)
    query = torch.randn(batch * q_len, kv_heads * group, head_dim, dtype=torch.bfloat16, device="cuda")
    query_start = torch.arange(0, batch * q_len + 1, q_len, dtype=torch.int32, device="cuda")
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    launch = LaunchShape(batch, q_len, choose_splits(batch, q_len, context, kv_heads, sms))

    def triton_run():
        return paged_attention(query, layer_k, layer_v, table, query_start, seq_lens, launch)

    long_table = table.long()

    def sdpa_run():
        k = layer_k[long_table].view(batch, width * BLOCK, kv_heads, head_dim)[:, :context].transpose(1, 2)
        v = layer_v[long_table].view(batch, width * BLOCK, kv_heads, head_dim)[:, :context].transpose(1, 2)
        q = query.view(batch, q_len, kv_heads * group, head_dim).transpose(1, 2)
        mask = None
        if q_len > 1:  # the chunk's queries are the last q_len positions
            mask = torch.ones(q_len, context, dtype=torch.bool, device="cuda").tril_(context - q_len)
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    reference = sdpa_run().transpose(1, 2).reshape(query.shape).float()
    error = (triton_run().float() - reference).norm() / reference.norm()
    triton_us = triton.testing.do_bench(triton_run, warmup=25, rep=200, return_mode="median") * 1e3
    sdpa_us = triton.testing.do_bench(sdpa_run, warmup=25, rep=200, return_mode="median") * 1e3
    kv_bytes = batch * context * 2 * kv_heads * head_dim * 2
    return {"triton_us": triton_us, "sdpa_gathered_us": sdpa_us, "kv_gb_per_s": kv_bytes / triton_us / 1e3,
            "relative_difference": error.item()}  # fmt: skip


def load_model():
    """``$KVD_GPU_MODEL`` as the engine loads it, or the random Llama built here on the GPU."""
    from inference import model_store
    from tests.gpu import random_llama

    folder = os.environ.get("KVD_GPU_MODEL")
    if folder and Path(folder, "config.json").exists():
        return model_store.load_model(Path(folder), torch.bfloat16, "cuda")
    with tempfile.TemporaryDirectory() as scratch:
        return random_llama.build(Path(scratch), device="cuda")


def run(quick: bool, save: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """Every case in turn; ``save`` gets the results after each (a failed
    case is recorded with its error, the others still run)."""
    from inference import attention

    results: dict[str, Any] = {"floor": {"read_bandwidth_gb_per_s": read_bandwidth() / 1e9}, "errors": {}}
    bandwidth = results["floor"]["read_bandwidth_gb_per_s"] * 1e9
    model = load_model()
    attention.choose_backend("triton", "cuda")
    model.set_attn_implementation(attention.BACKENDS["triton"])
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    weight_bytes -= model.model.embed_tokens.weight.numel() * model.model.embed_tokens.weight.element_size()
    results["floor"]["weight_bytes"] = weight_bytes

    def case(into: dict[str, Any], name: str, measure: Callable[[], dict[str, Any]]) -> None:
        harness.log(name)
        try:
            into[name] = measure()
        except Exception:
            results["errors"][name] = traceback.format_exc()
            harness.log(results["errors"][name])
        torch.cuda.empty_cache()
        save(results)

    case(results, "capture", lambda: time_capture(model))
    decode = results["decode"] = {}
    for batch in (1, 16, 64) if quick else BATCHES:  # the targets are read at 16 and 64
        for ctx_name, context in CONTEXTS.items():
            for shared in (True, False):
                name = f"b{batch}_{ctx_name}_{'shared' if shared else 'distinct'}"

                def measure(batch=batch, context=context, shared=shared, name=name):
                    chunks, cache, kv_bytes = decode_case(model, batch, context, shared)
                    floor = results["floor"][name] = (weight_bytes + kv_bytes) / bandwidth
                    return {**time_decode(model, chunks, cache, steps=10 if quick else 30), "floor_s": floor}

                case(decode, name, measure)
    attention_results = results["attention"] = {}
    for name, args in (("decode_ctx2000_b16", (16, 1, 2000)), ("decode_ctx2000_b64", (64, 1, 2000)),
                       ("prefill_512_over_2000", (1, 512, 2512))):  # fmt: skip
        case(attention_results, name, lambda args=args: time_attention(*args))
    return results


def build_ratios(results: dict[str, Any]) -> dict[str, float | None]:
    """The targets' ratios from what was measured (None where a case is missing)."""
    d, a = results.get("decode", {}), results.get("attention", {})
    bw = results["floor"]["read_bandwidth_gb_per_s"]

    def over_floor(name):
        return harness.ratio(d[name]["gpu_step_s"], d[name]["floor_s"]) if name in d else None

    b16 = d.get("b16_ctx2000_distinct", {})

    def speedup(case):  # SDPA-on-gathered time over Triton time
        return harness.ratio(a[case]["sdpa_gathered_us"], a[case]["triton_us"]) if case in a else None

    return {
        "decode_over_floor_b16": over_floor("b16_ctx2000_distinct"),
        "decode_over_floor_b64": over_floor("b64_ctx2000_distinct"),
        "wall_over_gpu_b16": harness.ratio(b16.get("wall_step_s"), b16.get("gpu_step_s")),
        "eager_over_graphed_wall_b16": harness.ratio(b16.get("wall_step_eager_s"), b16.get("wall_step_s")),
        "attention_bandwidth_share": harness.ratio(a.get("decode_ctx2000_b64", {}).get("kv_gb_per_s"), bw),
        "triton_over_sdpa_decode": speedup("decode_ctx2000_b64"),
        "triton_over_sdpa_prefill": speedup("prefill_512_over_2000"),
    }


def report(args: argparse.Namespace, results: dict[str, Any], complete: bool = True) -> dict[str, Any]:
    workload = {"model": "tests/gpu/random_llama.py (bfloat16)", "block_size": BLOCK, "batches": list(BATCHES),
                "contexts": CONTEXTS, "backend": "triton"}  # fmt: skip
    data = {"benchmark": "gpu_step", "quick": args.quick, "complete": complete,
            "machine": {**harness.machine_info(), "gpu": torch.cuda.get_device_name()}, "workload": workload,
            "results": results, "ratios": build_ratios(results)}  # fmt: skip
    return harness.rounded(data)


def table(report: dict[str, Any]) -> str:
    results = report["results"]
    rows = [(name, r["mode"], r["gpu_step_s"] * 1e3, r["gpu_elapsed_step_s"] * 1e3, r["wall_step_s"] * 1e3,
             r["gpu_step_eager_s"] * 1e3, r["wall_step_eager_s"] * 1e3, r["floor_s"] * 1e3,
             r["blocking_syncs_per_step"]) for name, r in results["decode"].items()]  # fmt: skip
    headers = ["decode", "mode", "gpu ms", "elapsed ms", "wall ms", "eager gpu ms", "eager wall ms", "floor ms",
               "syncs"]  # fmt: skip
    lines = [
        harness.format_table(headers, rows),
        harness.format_table(["capture", "value"], list(results.get("capture", {}).items())),
        harness.format_table(["ratio", "value"], list(report["ratios"].items())),
    ]
    lines += [f"{name} FAILED:\n{error}" for name, error in results["errors"].items()]
    return "\n".join(lines)


def measure_saving(args: argparse.Namespace, _folder: Path) -> dict[str, Any]:
    """Every case; the JSON rewritten after each, so a run cut short keeps the cases it measured."""
    return run(args.quick, lambda results: harness.write_json(args.json, report(args, results, complete=False)))


def failed(_args: argparse.Namespace, report: dict[str, Any]) -> int:
    """1 when a case failed."""
    return 1 if report["results"]["errors"] else 0


def main(argv: list[str] | None = None) -> int:
    args = harness.parser(__doc__, quick_help="batches 1, 16 and 64 only, fewer steps").parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_step.py measures the engine on a CUDA GPU and this machine has none: nothing measured, no JSON")
        return 2
    return harness.main(args, measure=measure_saving, report=report, table=table, verdict=failed)


if __name__ == "__main__":
    sys.exit(main())
