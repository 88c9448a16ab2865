"""The GPU run's first minute: what the machine is, whether every module
imports, every kernel variant compiled and launched once, CUDA IPC between
two processes, one graph capture against eager. What later parts need and
what explains their failures, written before any of them runs.

    python3 tests/gpu/preflight.py OUT.json

Writes OUT.json after each check (a cut run keeps the checks done), prints a
line per check and each failure's traceback as it happens. Exit status: 0
all passed, 1 a check failed, 3 CUDA IPC failed (the daemon+engine parts
cannot run; tests/gpu/run.sh skips them).
"""

from __future__ import annotations

import importlib
import json
import os
import pickle
import platform
import shutil
import subprocess
import sys
import textwrap
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "protos"), str(ROOT / "benchmarks")]  # the benchmarks import as scripts do

#: Every module the run imports, third-party first.
MODULES = (
    "torch", "triton", "transformers", "tokenizers", "safetensors", "numpy", "grpc", "grpc_health.v1.health_pb2",
    "grpc_reflection.v1alpha.reflection", "google.protobuf", "xxhash", "prometheus_client", "psutil", "click",
    "pytest", "pytest_timeout", "kvd.cli", "kvd.daemon", "kvd.common.memory", "kvd.offload", "kvd.common.client",
    "inference.cli", "inference.app", "inference.engine", "inference.cuda_graphs", "inference.kernels.paged_attention",
    "inference.kernels.kv_store", "tests.conftest", "tests.gpu.conftest", "tests.gpu.random_llama",
    "tests.integration.engine_client", "tests.model_families", "tests.kernel_variants", "tests.kernel_compile",
    "harness", "e2e", "gpu_step",
)  # fmt: skip
IPC_EXIT = 3


class Preflight:
    """Runs checks in order, each timed and caught; rewrites the JSON after each."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.report: dict[str, Any] = {}

    def check(self, name: str, run: Callable[[], Any]) -> bool:
        started = time.perf_counter()
        try:
            result = {"ok": True, **(run() or {})}
        except Exception as err:
            result = {"ok": False, "error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}
            print(f"--- {name} failed:\n{result['traceback']}", flush=True)
        result["seconds"] = round(time.perf_counter() - started, 2)
        self.report[name] = result
        self.out.write_text(json.dumps(self.report, indent=1, default=str))
        print(f"preflight {name}: {'ok' if result['ok'] else 'FAILED'} ({result['seconds']} s)", flush=True)
        return result["ok"]


def _command(*args: str) -> str:
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"({args[0]}: {err})"
    return (done.stdout + done.stderr).strip()


def environment() -> dict:
    """What the machine and its image are (nothing here needs the GPU)."""
    import torch
    from triton import knobs

    disks = {}
    for folder in ("/tmp", "/dev/shm"):
        usage = shutil.disk_usage(folder)
        disks[folder] = {"total_gb": round(usage.total / 1e9, 1), "free_gb": round(usage.free / 1e9, 1)}
    prefixes = ("PYTORCH_", "TRITON_", "CUDA_", "NVIDIA_", "KVD_")
    return {
        "nvidia_smi": _command(
            "nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm", "--format=csv,noheader"
        ),  # fmt: skip
        "kernel": platform.release(),
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "ptxas": _command(knobs.nvidia.ptxas.path, "--version").splitlines()[-1:],
        "disks": disks,
        "variables": {k: v for k, v in os.environ.items() if k.startswith(prefixes)},
        "pip": _command(sys.executable, "-m", "pip", "list", "--format=freeze").splitlines(),
    }


def gpu() -> dict:
    """The device as torch sees it."""
    import torch

    props = torch.cuda.get_device_properties(0)
    names = ("name", "major", "minor", "total_memory", "multi_processor_count", "L2_cache_size",
             "shared_memory_per_block_optin", "uuid")  # fmt: skip
    return {name: str(getattr(props, name, None)) if name == "uuid" else getattr(props, name, None) for name in names}


def imports() -> dict:
    failed = {}
    for name in MODULES:
        try:
            importlib.import_module(name)
        except Exception:
            failed[name] = traceback.format_exc()
            print(f"--- import {name} failed:\n{failed[name]}", flush=True)
    if failed:
        raise ImportError(f"{len(failed)} of {len(MODULES)} modules do not import: {', '.join(failed)}")
    return {"modules": len(MODULES)}


def kernels() -> dict:
    """Every variant compiled in parallel into Triton's cache (what the later
    parts would otherwise compile one by one), then every case launched."""
    import torch
    from triton import knobs

    from tests import kernel_compile, kernel_variants

    props = torch.cuda.get_device_properties(0)
    arch, sms = props.major * 10 + props.minor, props.multi_processor_count
    cases = list(kernel_variants.cases())
    variants, failures = kernel_compile.record_variants(cases, sms, arch)
    compiled = kernel_compile.compile_all(variants, [arch], min(12, os.cpu_count() or 1), knobs.cache.dir)
    launched = {}
    for case in cases:
        started = time.perf_counter()
        try:
            case.run(torch.device("cuda"), sms)
            torch.cuda.synchronize()
            launched[case.label] = round(time.perf_counter() - started, 2)
        except Exception:
            failures.append(f"{case.label}:\n{traceback.format_exc()}")
            print(f"--- {case.label} failed on the GPU:\n{failures[-1]}", flush=True)
    broken = [f"{r.kernel} ({r.case}; {r.constexprs}): {r.error}" for r in compiled if not r.ok]
    report = {"variants": len(variants), "launched_s": launched, "failures": failures, "not_compiled": broken}
    if failures or broken:
        raise RuntimeError(json.dumps(report, indent=1))
    return report


_CHILD = textwrap.dedent(
    """
    import pickle, sys, torch
    how, args = pickle.loads(sys.stdin.buffer.read())
    torch.cuda.init()  # _new_shared_cuda opens the handle in the current context: without one it segfaults
    if how == "torch":
        storage_args, shape, event_handle = args
        storage = torch.UntypedStorage._new_shared_cuda(*storage_args)
        tensor = torch.empty(0, dtype=torch.float32, device="cuda").set_(storage, 0, shape, (1,))
    else:
        from kvd.common.memory import map_kv_cache
        export, layout, shape, stride, event_handle = args
        tensor = map_kv_cache(export, layout, shape, stride).view(-1)
    torch.cuda.current_stream().wait_event(torch.cuda.Event.from_ipc_handle(tensor.device, event_handle))
    expected = torch.arange(tensor.numel(), device="cuda", dtype=torch.float32).to(tensor.dtype)
    assert torch.equal(tensor, expected), "the mapped memory does not hold what the parent wrote"
    tensor.fill_(7)
    torch.cuda.synchronize()
    """
)


def _run_child(how: str, args: tuple) -> None:
    path = os.pathsep.join([str(ROOT), str(ROOT / "protos"), os.environ.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", _CHILD], input=pickle.dumps((how, args)), capture_output=True,
                          timeout=60, cwd=ROOT, env={**os.environ, "PYTHONPATH": path})  # fmt: skip
    if done.returncode:
        output = (done.stdout + done.stderr).decode(errors="replace")[-4000:]
        raise RuntimeError(f"the child failed ({how}, exit {done.returncode}): {output}")


def cuda_ipc() -> dict:
    """A child process maps a tensor and waits on an interprocess event: with
    torch's own calls, then through kvd.common.memory (the daemon's export)."""
    import torch

    from kvd.common.layout import CacheLayout
    from kvd.common.memory import KVMemory

    event = torch.cuda.Event(interprocess=True)
    tensor = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
    event.record()
    storage_args = tensor.untyped_storage()._share_cuda_()
    _run_child("torch", (storage_args, tuple(tensor.shape), event.ipc_handle()))
    torch.cuda.synchronize()
    assert torch.all(tensor == 7), "the child's write through torch's IPC is not seen here"

    layout = CacheLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, dtype="bfloat16")
    memory = KVMemory(layout, 8, "cuda")
    flat = memory.tensor.view(-1)
    flat.copy_(torch.arange(flat.numel(), device="cuda", dtype=torch.float32).to(flat.dtype))
    event.record()
    _run_child("kvd", (memory.export, layout, memory.shape, memory.stride, event.ipc_handle()))
    torch.cuda.synchronize()
    assert torch.all(flat == 7), "the child's write through kvd.common.memory's export is not seen here"
    return {"allocator": {k: os.environ.get(k) for k in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")}}


def graph_capture() -> dict:
    """The default model's stand-in (bfloat16): a decode and a mixed step
    replayed from their graphs equal the same padded steps run eagerly."""
    import torch

    from inference.cuda_graphs import CudaGraphCapture, GraphPlan, capture_graphs
    from inference.step_inputs import Chunk
    from tests.kernel_variants import engine_models, stand_in_runner

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    runner = stand_in_runner(engine_models()[0], torch.bfloat16, torch.device("cuda"), sms)
    runner.graphs = capture_graphs(runner, GraphPlan((1, 4), (64,), 4, 4096), CudaGraphCapture(runner.device))
    if runner.graphs is None:
        raise RuntimeError("capture failed (its error is logged above)")
    steps = {
        "decode 4": [
            Chunk([5 + i], 100 * i + 7, list(range(20 * i, 20 * i + 20)), 100 * i + 7, True, f"d{i}") for i in range(4)
        ],  # fmt: skip
        "mixed": [Chunk(list(range(3, 33)), 0, [100, 101], 0, True, "p")],
    }
    differences = {}
    for name, chunks in steps.items():
        cache = runner.kv_cache.clone()
        graphed = runner.forward(chunks).clone()
        runner.kv_cache.copy_(cache)
        eager = runner.graphs.eager(chunks)
        differences[name] = (graphed.float() - eager.float()).abs().max().item()
    if any(differences.values()) or runner.graphs.replays != len(steps):
        raise AssertionError(f"replays {runner.graphs.replays}; max |graph - eager| per step: {differences}")
    return {"capture_s": round(runner.graphs.capture_s, 2), "max_difference": differences}


def main() -> int:
    preflight = Preflight(Path(sys.argv[1]))
    preflight.check("environment", environment)
    found = preflight.check("gpu", gpu)
    imported = preflight.check("imports", imports)
    ipc = preflight.check("cuda_ipc", cuda_ipc) if imported and found else False
    ok = found and imported and ipc
    if imported and found:
        ok &= preflight.check("kernels", kernels)
        ok &= preflight.check("graph_capture", graph_capture)
    if not ipc:
        return IPC_EXIT
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
