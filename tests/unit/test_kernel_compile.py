"""Every Triton kernel variant the engine can launch compiles for the H100
(sm_90) and the A100 (sm_80), fits a block's shared memory there, reads its
step inputs as int32, and is compiled once however the steps vary: the GPU
compiler's checks, which Triton's CPU interpreter (tests/unit/test_kernels.py)
never makes, run here without a GPU (tests/kernel_compile.py).

Its table (registers, spills, shared memory, compile time per variant) is
printed with the test's result."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")
pytestmark = pytest.mark.needs_triton

RANDOM_STEPS = 100


def test_every_kernel_variant_compiles_for_sm90_and_sm80_and_steps_never_recompile(tmp_path, capsys):
    report_path = tmp_path / "kernels.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the real compiler, not the interpreter
    command = [sys.executable, "-m", "tests.kernel_compile", "--arch", "90", "--arch", "80",
               "--random-steps", str(RANDOM_STEPS), "--json", str(report_path)]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    with capsys.disabled():
        print(f"\n{done.stdout}")
    assert done.returncode == 0, done.stderr[-20000:]
    report = json.loads(report_path.read_text())
    compiled = report["compiled"]
    # The catalog reached what it claims to cover: both targets, every kernel,
    # head dims 64/128/256, a GQA group that is not a power of two, decode,
    # split-KV and prefill tiles, soft-capping with a sliding window, three dtypes.
    assert {r["arch"] for r in compiled} == {90, 80}
    assert {r["kernel"] for r in compiled} == {"_paged_attention_kernel", "_merge_splits_kernel", "_store_kv_kernel"}
    assert {r["dtype"] for r in compiled if r["kernel"] != "_merge_splits_kernel"} == {"bf16", "fp16", "fp32"}
    attention = " | ".join(r["constexprs"] for r in compiled if r["kernel"] == "_paged_attention_kernel")
    for fragment in ("HEAD_DIM=64", "HEAD_DIM=128", "HEAD_DIM=256", "GROUP=3", "GROUP=6", "SPLIT=True",
                     "BLOCK_M=64", "SOFTCAP=True WINDOW=True", "PRECISION=ieee", "PRECISION=tf32"):  # fmt: skip
        assert fragment in attention, fragment
    steps = report["random_steps"]
    assert steps["variants"] == steps["constexpr_combinations"] >= 4
