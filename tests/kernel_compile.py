"""Compiles every Triton kernel variant the engine can launch for GPU targets,
on a machine without a GPU: what Triton's CPU interpreter cannot check (a
kernel the GPU compiler refuses, shared memory past a block's limit, spills).

    python -m tests.kernel_compile [--arch 90 --arch 80] [--json FILE] [--random-steps N]

How, in two phases:

1. **record**: Triton's active driver is replaced by one that names a CUDA
   target and launches nothing; tests/kernel_variants.py's cases run the
   engine's own code (its runner, graph capture and kernel wrappers) on CPU
   tensors, and every launch's specialization (argument types, alignments,
   constexprs, options), what Triton keys its compiled kernels by, is
   recorded instead of compiled;
2. **compile**: each distinct variant goes through ``triton.compile`` for
   ``GPUTarget("cuda", arch, 32)`` (Triton ships ``ptxas``: no CUDA install),
   in a fresh cache, in parallel, with ptxas's report of registers, spills
   and stack frame, and the shared memory each program needs.

Its exit status is 1 when a variant fails to compile, needs more shared memory
than a block of that GPU gets, or reads a step input in another dtype than
int32 (the graphs' static inputs are int32: another dtype would be another
variant). ``--random-steps N`` also runs the default model's capture and N
random eager steps, and fails when they compiled more than one variant per
constexpr combination (an argument Triton specializes on that changes from
step to step: a recompile in the middle of serving).

Must run without ``TRITON_INTERPRET`` (it spawns itself with it removed when
it is set).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

#: Per-block shared memory a kernel may opt into, and multiprocessors, per compute capability.
GPUS = {
    90: {"name": "H100", "shared_bytes": 232_448, "sms": 132},
    80: {"name": "A100", "shared_bytes": 166_912, "sms": 108},
}
#: Launch options a wrapper sets (the others are the target's defaults).
_LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")
#: The step inputs the graphs keep in static int32 buffers, by kernel.
_INT32_INPUTS = {
    "_paged_attention_kernel": ("block_table", "query_start", "seq_lens"),
    "_store_kv_kernel": ("slot_mapping",),
}


@dataclass(frozen=True)
class Variant:
    """One compiled kernel's inputs, as Triton's launch computes them."""

    module: str
    kernel: str
    signature: dict
    constexprs: dict
    attrs: dict
    options: dict

    @property
    def dtype(self) -> str:
        """The element type of its first tensor (queries, new keys, output)."""
        return next(t for t in self.signature.values() if t.startswith("*")).removeprefix("*")

    @property
    def constexpr_text(self) -> str:
        """The kernel's own constexprs (the strides Triton specialized to 1 left out)."""
        names = list(self.signature)
        named = {names[path[0]]: value for path, value in self.constexprs.items()}
        return " ".join(f"{k}={v}" for k, v in named.items() if not k.startswith("stride_"))


@dataclass
class Compiled:
    """What compiling one variant for one target gave."""

    kernel: str
    arch: int
    case: str
    dtype: str
    constexprs: str
    num_warps: int
    ok: bool = False
    seconds: float = 0.0
    shared_bytes: int | None = None
    registers: int | None = None
    spill_store_bytes: int | None = None
    spill_load_bytes: int | None = None
    stack_frame_bytes: int | None = None
    error: str | None = None
    problems: list[str] = field(default_factory=list)


# ------------------------------------------------------------------ record


def _recording_driver(arch: int):
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.backends.driver import DriverBase

    class RecordingDriver(DriverBase):
        """Names a CUDA target; launches and compiles nothing."""

        @classmethod
        def is_active(cls):
            return False

        def map_python_to_cpp_type(self, ty):
            raise NotImplementedError

        def get_current_target(self):
            return GPUTarget("cuda", arch, 32)

        def get_active_torch_device(self):
            return torch.device("cpu")

        def get_benchmarker(self):
            raise NotImplementedError

        def get_current_device(self):
            return 0

        def get_current_stream(self, device):
            return 0

    return RecordingDriver()


@dataclass
class Recording:
    """What :func:`recording` saw: each variant (keyed by kernel and Triton's
    cache key) with the case that launched it first (``case`` when it did)."""

    case: str = ""
    found: dict[tuple[str, str], tuple[Variant, str]] = field(default_factory=dict)


@contextlib.contextmanager
def recording(arch: int = 90) -> Iterator[Recording]:
    """Within it, a kernel launch records its variant instead of compiling and launching."""
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    recorded, launched = Recording(), set()
    original = JITFunction._do_compile

    def record(self, key, signature, device, constexprs, options, attrs, warmup):
        variant = Variant(
            self.fn.__module__, self.fn.__name__, dict(signature), dict(constexprs), dict(attrs),
            {name: getattr(options, name) for name in _LAUNCH_OPTIONS},
        )  # fmt: skip
        recorded.found.setdefault((self.fn.__name__, str(key)), (variant, recorded.case))
        launched.add(self)
        return None  # the launch returns without running anything

    previous = driver._active  # None until something asked for it: there may be no driver to make here
    JITFunction._do_compile = record
    driver.set_active(_recording_driver(arch))
    try:
        yield recorded
    finally:
        JITFunction._do_compile = original
        driver._active = previous
        for kernel in launched:
            kernel.device_caches.clear()  # their binders were made for the recording target


def record_variants(cases, num_sms: int, arch: int = 90) -> tuple[list[tuple[Variant, str]], list[str]]:
    """Runs the cases on CPU tensors, recording as for ``sm_{arch}``; returns
    the distinct variants (each with the case that first launched it) and the
    cases' failures."""
    import torch

    failures = []
    with recording(arch) as recorded:
        for case in cases:
            recorded.case = case.label
            try:
                case.run(torch.device("cpu"), num_sms)
            except Exception:
                failures.append(f"{case.label}:\n{traceback.format_exc()}")
    return list(recorded.found.values()), failures


def input_dtype_problems(variant: Variant) -> list[str]:
    """The step inputs this variant reads in another dtype than int32."""
    return [
        f"{name} is {variant.signature[name]}, not *i32"
        for name in _INT32_INPUTS.get(variant.kernel, ())
        if variant.signature.get(name) != "*i32"
    ]


# ------------------------------------------------------------------ compile

_PTXAS = {
    "registers": r"Used (\d+) registers",
    "spill_store_bytes": r"(\d+) bytes spill stores",
    "spill_load_bytes": r"(\d+) bytes spill loads",
    "stack_frame_bytes": r"(\d+) bytes stack frame",
}


def compile_variant(variant: Variant, case: str, arch: int) -> Compiled:
    """Compiles one variant for ``sm_{arch}`` (in this process: Triton's cache
    must be a fresh one for ptxas's report to be printed)."""
    import importlib

    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    result = Compiled(variant.kernel, arch, case, variant.dtype, variant.constexpr_text, variant.options["num_warps"])
    kernel = getattr(importlib.import_module(variant.module), variant.kernel)
    source = ASTSource(kernel, variant.signature, variant.constexprs, variant.attrs)
    log = io.StringIO()
    started = time.perf_counter()
    knobs.nvidia.dump_ptxas_log = True
    try:
        with contextlib.redirect_stdout(log):
            compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=dict(variant.options))
    except Exception as err:
        result.error = f"{type(err).__name__}: {err}"
        return result
    finally:
        result.seconds = time.perf_counter() - started
    result.ok = True
    result.shared_bytes = compiled.metadata.shared
    for name, pattern in _PTXAS.items():
        match = re.search(pattern, log.getvalue())
        setattr(result, name, int(match.group(1)) if match else None)
    limit = GPUS[arch]["shared_bytes"]
    if result.shared_bytes > limit:
        result.problems.append(f"needs {result.shared_bytes} bytes of shared memory; a block gets {limit}")
    return result


def _compile_in_worker(job: tuple[Variant, str, int]) -> Compiled:
    return compile_variant(*job)


def compile_all(
    variants: list[tuple[Variant, str]], archs: list[int], workers: int, cache_dir: str | None = None
) -> list[Compiled]:
    """Every variant for every target, in ``workers`` fresh processes, the
    slowest first (float32's IEEE dots), into ``cache_dir`` (None: a fresh
    one, so that every variant is compiled and ptxas reports on each; a GPU
    machine's own cache: its later launches find them compiled)."""
    jobs = [(variant, case, arch) for arch in archs for variant, case in variants]
    jobs.sort(key=lambda job: job[0].dtype != "fp32")
    previous = os.environ.get("TRITON_CACHE_DIR")
    with tempfile.TemporaryDirectory(prefix="kvd-triton-cache-") as fresh:
        os.environ["TRITON_CACHE_DIR"] = cache_dir or fresh  # the workers inherit it
        try:
            context = multiprocessing.get_context("spawn")  # no inherited torch threads
            with ProcessPoolExecutor(workers, mp_context=context) as pool:
                results = list(pool.map(_compile_in_worker, jobs))
        finally:
            if previous is None:
                del os.environ["TRITON_CACHE_DIR"]
            else:
                os.environ["TRITON_CACHE_DIR"] = previous
    for result, (variant, _, _) in zip(results, jobs, strict=True):
        result.problems += input_dtype_problems(variant)
    return results


# ------------------------------------------------------------------ report


def table(results: list[Compiled]) -> str:
    from benchmarks.harness.report import format_table

    rows = [
        (f"sm_{r.arch}", r.kernel.strip("_").removesuffix("_kernel"), r.case, r.dtype, r.constexprs, r.num_warps,
         r.shared_bytes, r.registers, r.spill_store_bytes, r.stack_frame_bytes, round(r.seconds, 1),
         "ok" if r.ok and not r.problems else "FAILED")
        for r in sorted(results, key=lambda r: (r.arch, r.kernel, r.case, r.constexprs))
    ]  # fmt: skip
    headers = ["target", "kernel", "first launched by", "dtype", "constexprs", "warps", "shared B", "regs",
               "spill st B", "stack B", "compile s", ""]  # fmt: skip
    return format_table(headers, rows)


def random_steps_check(steps: int, num_sms: int) -> dict:
    """How many variants the default model's capture and ``steps`` random
    eager steps compiled, against their constexpr combinations."""
    from tests.kernel_variants import random_steps_case

    variants, failures = record_variants([random_steps_case(steps)], num_sms)
    combos = {(v.kernel, v.constexpr_text) for v, _ in variants}
    return {"steps": steps, "variants": len(variants), "constexpr_combinations": len(combos), "failures": failures}


def run(archs: list[int], workers: int, random_steps: int) -> dict:
    from tests.kernel_variants import cases

    started = time.perf_counter()
    num_sms = GPUS[archs[0]]["sms"]
    variants, failures = record_variants(list(cases()), num_sms)
    recorded_s = time.perf_counter() - started
    results = compile_all(variants, archs, workers)
    report = {
        "targets": {f"sm_{a}": GPUS[a] for a in archs},
        "variants": len(variants),
        "record_s": round(recorded_s, 1),
        "compile_s": round(time.perf_counter() - started - recorded_s, 1),
        "case_failures": failures,
        "compiled": [asdict(r) for r in results],
    }
    if random_steps:
        report["random_steps"] = random_steps_check(random_steps, num_sms)
    return report


def failed(report: dict) -> list[str]:
    """What the report shows as broken, one line each."""
    lines = [f"case failed: {f}" for f in report["case_failures"]]
    for r in report["compiled"]:
        where = f"sm_{r['arch']} {r['kernel']} ({r['case']}; {r['constexprs']})"
        if not r["ok"]:
            lines.append(f"{where} does not compile: {r['error']}")
        lines += [f"{where}: {problem}" for problem in r["problems"]]
    steps = report.get("random_steps")
    if steps:
        lines += [f"random steps: {f}" for f in steps["failures"]]
        if steps["variants"] != steps["constexpr_combinations"]:
            lines.append(
                f"{steps['steps']} random steps compiled {steps['variants']} variants of "
                f"{steps['constexpr_combinations']} constexpr combinations: an argument changing from step to "
                "step is specialized on (a recompile while serving)"
            )
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", type=int, action="append", choices=sorted(GPUS), help="compute capability (90, 80: both)")
    p.add_argument("--json", help="write the report here")
    p.add_argument("--workers", type=int, default=os.cpu_count(), help="compiling processes")
    p.add_argument("--random-steps", type=int, default=0, help="also check N random eager steps (see above)")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET"):
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        return subprocess.run([sys.executable, "-m", "tests.kernel_compile", *sys.argv[1:]], env=env).returncode
    report = run(args.arch or [90, 80], args.workers, args.random_steps)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    print(table([Compiled(**r) for r in report["compiled"]]))
    print(f"{report['variants']} variants recorded in {report['record_s']} s, compiled in {report['compile_s']} s")
    problems = failed(report)
    for line in problems:
        print(line, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
