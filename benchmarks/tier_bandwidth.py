"""Host-tier copy bandwidth on CUDA, against a plain pinned-memory copy of the same bytes.

The daemon's copier (kvd/offload.py) moves blocks one by one between the GPU
cache and its pinned host tensor, on its own stream; the baseline is one
``copy_`` of the same number of bytes between a contiguous device tensor and
a contiguous pinned tensor. Both directions, medians of several repeats, in
one run. The layout is the GPU runs' random Llama (16 layers, 8 KV heads,
head dim 128, 16-token blocks, bfloat16: 1 MiB per block) unless flags say
otherwise.

    python3 benchmarks/tier_bandwidth.py --json FILE [--blocks N] [--repeats R]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from typing import Any

import harness
import torch

from kvd.block import Block
from kvd.common.layout import CacheLayout
from kvd.host_tier import HostSlot
from kvd.offload import TierCopier


def timed(fn, repeats: int) -> float:
    """Median seconds of ``fn()`` (which must wait for its own copies)."""
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(layout: CacheLayout, num_blocks: int, repeats: int) -> dict:
    cache = torch.randn((num_blocks, *layout.block_shape), device="cuda").to(layout.torch_dtype)
    copier = TierCopier(cache, num_blocks, threading.Lock(), lambda _: None, lambda _: None)
    # Every other block, as a real cache's blocks are scattered; into as many slots.
    blocks = [Block(block_id=i) for i in range(0, num_blocks, 2)]
    slots = [HostSlot(slot_id=i) for i in range(len(blocks))]
    nbytes = len(blocks) * layout.block_bytes

    def tier_out():
        copier.copy_out(list(zip(blocks, slots, strict=True)))
        copier.wait_for_copies()

    def tier_in():
        copier.copy_in(list(zip(slots, blocks, strict=True)))
        copier.wait_for_copies()

    device_flat = cache[: len(blocks)].contiguous()
    host_flat = torch.empty_like(device_flat, device="cpu").pin_memory()

    def plain_out():
        host_flat.copy_(device_flat, non_blocking=True)
        torch.cuda.synchronize()

    def plain_in():
        device_flat.copy_(host_flat, non_blocking=True)
        torch.cuda.synchronize()

    results = {}
    for direction, tier, plain in (("to_host", tier_out, plain_out), ("from_host", tier_in, plain_in)):
        tier_s, plain_s = timed(tier, repeats), timed(plain, repeats)
        results[direction] = {
            "bytes": nbytes,
            "tier_s": tier_s,
            "plain_s": plain_s,
            "tier_gb_per_s": nbytes / tier_s / 1e9,
            "plain_gb_per_s": nbytes / plain_s / 1e9,
        }
    # The copies really moved the bytes: block 2i is in slot i.
    assert torch.equal(copier.host[: len(blocks)].to("cuda"), cache[0:num_blocks:2][: len(blocks)])
    copier.close()
    return results


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = harness.parser(__doc__, quick_help=None)
    p.add_argument("--blocks", type=int, default=1024, help="device blocks; half of them are copied")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    return p.parse_args(argv)


def cache_layout(args: argparse.Namespace) -> CacheLayout:
    return CacheLayout(args.layers, args.kv_heads, args.head_dim, args.block_size, "bfloat16")


def report(args: argparse.Namespace, results: dict[str, Any]) -> dict[str, Any]:
    layout = cache_layout(args)
    return {
        "benchmark": "tier_bandwidth",
        "quick": False,
        "machine": {**harness.machine_info(), "gpu": torch.cuda.get_device_name()},
        "workload": {
            "layout": layout.describe(),
            "block_bytes": layout.block_bytes,
            "blocks_copied": args.blocks // 2,
            "repeats": args.repeats,
            "tier": (
                "TierCopier.copy_out / copy_in, one copy_ per block on the copier's stream, timed to wait_for_copies()"
            ),
            "plain": "one copy_ of the same bytes, contiguous device <-> contiguous pinned host, synchronized",
        },
        "results": harness.rounded(results),
        "ratios": harness.rounded(
            {
                "to_host_over_plain": results["to_host"]["tier_gb_per_s"] / results["to_host"]["plain_gb_per_s"],
                "from_host_over_plain": results["from_host"]["tier_gb_per_s"] / results["from_host"]["plain_gb_per_s"],
            }
        ),
    }


def table(report: dict[str, Any]) -> str:
    rows = [
        [d, r["tier_gb_per_s"], r["plain_gb_per_s"], report["ratios"][f"{d}_over_plain"]]
        for d, r in report["results"].items()
    ]
    return harness.format_table(["direction", "tier GB/s", "plain GB/s", "ratio"], rows)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("tier_bandwidth: needs a CUDA GPU", file=sys.stderr)
        return 2
    return harness.main(
        args,
        measure=lambda args, _folder: measure(cache_layout(args), args.blocks, args.repeats),
        report=report,
        table=table,
    )


if __name__ == "__main__":
    sys.exit(main())
