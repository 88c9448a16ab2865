"""The CPU prefill attention kernel against torch's SDPA, and against another
build of the kernels' source, with the machine's own products beside them.

    .venv/bin/python benchmarks/cpu_kernels.py --json FILE [--quick] [--against OLD_CPU_C]

In one process, float32, a layer's call repeated for 30 layers (SmolLM2's
count) per timing, the variants alternating round by round
(``harness.turn_order``), medians of the rounds:

- ``kernel``: ``inference.kernels.cpu.prefill_chunks`` as the engine builds
  and calls it, over the K/V laid into a layer's cache in blocks of
  ``BLOCK`` positions (in order);
- ``sdpa``: ``F.scaled_dot_product_attention`` with grouped KV heads on the
  same tensors, causal, bottom-right aligned by an explicit mask where the
  chunk follows cached positions (what the engine's torch path runs);
- ``against`` (with ``--against FILE``): the same kernel built from FILE,
  for instance ``git show REV:inference/kernels/cpu.c > /tmp/old.c``: a
  change to the kernel measured beside its parent in one run (a build
  with ``kvd_prefill_chunks_f32``: 82db27b on).

Each case's FLOPs (the query-key pairs a causal chunk computes, two products
of ``head_dim`` multiply-adds each) give GFLOP/s; ``floor_ms`` is the time
those FLOPs take at the rate of the machine's float32 products
(``linear_gflop_per_s``: the engine's packed oneDNN product of 512 x 576 by
576 x 1536, the size of SmolLM2's MLP products in a prefill chunk), the
arithmetic floor.
Outputs of every variant are compared with float64 attention.
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import harness

LAYERS = 30
#: Positions per block of the cache the kernel reads (the engine's default).
BLOCK = 16
#: case -> (heads, kv heads, head dim, query tokens, key positions: the last q_len of them are the queries')
CASES = {
    "square_512": (9, 3, 64, 512, 512),
    "square_384": (9, 3, 64, 384, 384),
    "128_after_512": (9, 3, 64, 128, 640),
    "40_after_600": (9, 3, 64, 40, 640),
    "head_dim_128_groups_of_4": (16, 4, 128, 512, 512),
}
QUICK_CASES = ("square_512", "40_after_600")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = harness.parser(__doc__)
    p.add_argument("--against", help="another cpu.c to build and time beside the engine's")
    p.add_argument("--rounds", type=int, help="alternations (default 5; quick 3)")
    return p.parse_args(argv)


def build_against(source: Path, folder: Path) -> ctypes.CDLL:
    """``source`` built with the engine's flags, its prefill entry point typed as the engine types it."""
    from inference.kernels import cpu

    built = folder / "against.so"
    subprocess.run([cpu._compiler(), *cpu.FLAGS, str(source), "-o", str(built), "-lm"], check=True)
    library = ctypes.CDLL(str(built))
    library.kvd_prefill_chunks_f32.restype = ctypes.c_int
    library.kvd_prefill_chunks_f32.argtypes = cpu.load().kvd_prefill_chunks_f32.argtypes
    return library


def causal_pairs(q_len: int, k_len: int) -> int:
    """Query-key pairs a causal chunk of the last ``q_len`` of ``k_len`` positions computes."""
    first = k_len - q_len
    return sum(first + t + 1 for t in range(q_len))


def linear_gflop_per_s(rounds: int) -> float:
    """The rate of the engine's float32 products (oneDNN, the weight packed once:
    ``inference.cpu_linear``) at the size of SmolLM2's MLP products in a 512-token chunk."""
    import torch

    from inference import cpu_linear

    linear = torch.nn.Linear(576, 1536, bias=False)
    product = cpu_linear.PackedLinear(linear) if cpu_linear.available() else linear
    x = torch.randn(1, 512, 576)
    with torch.no_grad():
        product(x)
        best = min(timed(lambda: product(x), 20) for _ in range(rounds))
    return 2 * 512 * 576 * 1536 * 20 / best / 1e9


def timed(call, times: int) -> float:
    began = time.perf_counter()
    for _ in range(times):
        call()
    return time.perf_counter() - began


def run(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    import torch

    from inference import heap
    from inference.kernels import cpu

    heap.keep_freed_memory()  # as the engine runs: freed activations stay in the heap
    if not cpu.use(True):
        raise SystemExit("the C kernels did not build on this machine")
    against = build_against(Path(args.against), folder) if args.against else None
    rounds = args.rounds or (3 if args.quick else 5)
    gen = torch.Generator().manual_seed(0)
    results = {name: measure_case(CASES[name], against, rounds, gen) for name in (QUICK_CASES if args.quick else CASES)}
    peak = linear_gflop_per_s(rounds)
    for r in results.values():
        r["floor_ms"] = r["gflop"] / peak * 1e3
    workload = {"layers": LAYERS, "rounds": rounds, "dtype": "float32", "cases": {n: CASES[n] for n in results},
                "against": args.against, "linear_gflop_per_s": peak}  # fmt: skip
    return {"workload": workload, "results": results}


def measure_case(case: tuple[int, ...], against: ctypes.CDLL | None, rounds: int, gen) -> dict[str, Any]:
    """One case's variants, alternating: medians of ``rounds`` timings of LAYERS calls each."""
    import torch
    import torch.nn.functional as F

    from inference.kernels import cpu

    heads, kv_heads, dim, q_len, k_len = case
    q = torch.randn(q_len, heads, dim, generator=gen).transpose(0, 1)  # [heads, q_len, d], strided as the model's
    k, v = torch.randn(k_len, kv_heads, dim, generator=gen), torch.randn(k_len, kv_heads, dim, generator=gen)
    mask = torch.ones(q_len, k_len, dtype=torch.bool).tril(k_len - q_len)
    outs = {variant: torch.empty(q_len, heads, dim) for variant in ("kernel", "sdpa", "against")}
    blocks = -(-k_len // BLOCK)
    layer_k, layer_v = (torch.zeros(blocks * BLOCK, kv_heads, dim) for _ in range(2))
    layer_k[:k_len], layer_v[:k_len] = k, v
    layer_k, layer_v = layer_k.view(blocks, BLOCK, kv_heads, dim), layer_v.view(blocks, BLOCK, kv_heads, dim)
    chunks, table = torch.tensor([[0, q_len, k_len, 0]]), torch.arange(blocks)  # one chunk, its blocks in order

    def kernel() -> None:
        cpu.prefill_chunks(q, layer_k, layer_v, chunks, table, outs["kernel"], dim**-0.5)

    def other_build() -> None:
        out = outs["against"]
        f32, i64 = ctypes.POINTER(ctypes.c_float), ctypes.POINTER(ctypes.c_int64)
        code = against.kvd_prefill_chunks_f32(
            q.data_ptr(), q.stride(0), q.stride(1), ctypes.cast(layer_k.data_ptr(), f32),
            ctypes.cast(layer_v.data_ptr(), f32), layer_k.stride(0), layer_k.stride(1),
            ctypes.cast(chunks.data_ptr(), i64), 1, ctypes.cast(table.data_ptr(), i64),
            ctypes.cast(out.data_ptr(), f32), out.stride(0), heads, kv_heads, dim, BLOCK, dim**-0.5,
        )  # fmt: skip
        assert code == 0, code

    def sdpa() -> None:
        o = F.scaled_dot_product_attention(
            q[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=mask, enable_gqa=True
        )
        outs["sdpa"].copy_(o[0].transpose(0, 1))

    calls = {"kernel": kernel, "sdpa": sdpa, **({"against": other_build} if against is not None else {})}
    seconds: dict[str, list[float]] = {variant: [] for variant in calls}
    for r in range(rounds):
        for variant in harness.turn_order(list(calls), r):
            seconds[variant].append(timed(calls[variant], LAYERS))
    want = reference(q, k, v, mask)
    flops = 4 * causal_pairs(q_len, k_len) * heads * dim * LAYERS
    return {
        "shape": {"heads": heads, "kv_heads": kv_heads, "head_dim": dim, "q_len": q_len, "k_len": k_len},
        "gflop": flops / 1e9,
        **{f"{variant}_ms": harness.median(s) * 1e3 for variant, s in seconds.items()},
        **{f"{variant}_gflop_per_s": flops / harness.median(s) / 1e9 for variant, s in seconds.items()},
        **{f"{variant}_max_error": (outs[variant].double() - want).abs().max().item() for variant in calls},
    }


def reference(q, k, v, mask):
    """float64 attention, each query head over its KV head's keys: ``[q_len, heads, d]``."""
    import torch

    group = q.shape[0] // k.shape[1]
    keys = k.double().repeat_interleave(group, 1).transpose(0, 1)  # [heads, k_len, d]
    values = v.double().repeat_interleave(group, 1).transpose(0, 1)
    scores = (q.double() @ keys.transpose(1, 2)) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~mask, float("-inf"))
    return (torch.softmax(scores, -1) @ values).transpose(0, 1)


def report(args: argparse.Namespace, measured: dict[str, Any]) -> dict[str, Any]:
    results = measured["results"]
    ratios: dict[str, Any] = {}
    for name, r in results.items():
        ratios[f"{name}_kernel_over_sdpa"] = harness.ratio(r["kernel_ms"], r["sdpa_ms"])
        ratios[f"{name}_kernel_over_floor"] = harness.ratio(r["kernel_ms"], r["floor_ms"])
        if "against_ms" in r:
            ratios[f"{name}_kernel_over_against"] = harness.ratio(r["kernel_ms"], r["against_ms"])
    return harness.stack_report("cpu_kernels", args.quick, measured["workload"], harness.rounded(results),
                                harness.rounded(ratios))  # fmt: skip


def table(report: dict[str, Any]) -> str:
    rows = []
    for name, r in report["results"].items():
        rows.append([name, r["kernel_ms"], r.get("against_ms", "-"), r["sdpa_ms"], r["floor_ms"],
                     r["kernel_gflop_per_s"], r["kernel_max_error"]])  # fmt: skip
    peak = report["workload"]["linear_gflop_per_s"]
    return "\n".join([
        harness.format_table(["case (30 layers)", "kernel ms", "against ms", "sdpa ms", "floor ms", "kernel GFLOP/s",
                              "max error"], rows),  # fmt: skip
        f"the floor: each case's FLOPs at the machine's float32 product rate ({peak:.0f} GFLOP/s)",
    ])  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    return harness.main(parse_args(argv), measure=run, report=report, table=table)


if __name__ == "__main__":
    sys.exit(main())
