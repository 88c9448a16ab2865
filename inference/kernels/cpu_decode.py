"""Paged decode attention on the CPU (``cpu_decode.c``), built on first use.

The torch path gathers every sequence's blocks into a contiguous buffer per
layer and runs torch's fused attention over it: the K/V bytes are read,
written and read again. This kernel reads them once, where they lie
(docs/benchmarks.md has the figures). It is float32 only; other dtypes, soft-
capped and windowed layers take the torch path.

The C source is compiled once per machine with the C compiler on ``PATH``
(``$CC``, else ``cc``) into ``$XDG_CACHE_HOME/kvd/kernels`` (``-march=native``:
the file's name carries a digest of the source, the flags, the compiler's
version and the CPU's feature flags), then loaded with ctypes, which releases
the GIL for the call. Without a compiler, or when the build fails, ``load``
returns None once and the engine keeps the torch path; the engine's
``--no-cpu-decode-kernel`` asks for that path (``use(False)``).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger("inference.kernels.cpu_decode")

SOURCE = Path(__file__).with_name("cpu_decode.c")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")
_I64, _F32P = ctypes.c_int64, ctypes.POINTER(ctypes.c_float)
_I64P = ctypes.POINTER(ctypes.c_int64)


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvd" / "kernels"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            return next((line for line in info if line.startswith("flags")), "")
    except OSError:
        return ""


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc"))


def _build(compiler: str) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(FLAGS).encode(), version.encode(), _cpu_flags().encode()):
        digest.update(part)
    target = cache_dir() / f"cpu_decode-{digest.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Built beside its final name, then renamed: engines starting together never load half a file.
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(built), "-lm"], capture_output=True, check=True)
        os.replace(built, target)
    return target


#: whether decodes may take the kernel (the engine's setting; ``use``)
_wanted = True


def use(wanted: bool) -> bool:
    """Turns the kernel on or off for this process (building it if wanted); returns whether it runs."""
    global _wanted
    _wanted = wanted
    return wanted and load() is not None


@functools.cache
def load() -> ctypes.CDLL | None:
    """The built kernel library, or None (the torch path): no compiler, or a failed build."""
    compiler = _compiler()
    if compiler is None:
        log.info("no C compiler: CPU decode attention gathers blocks (the torch path)")
        return None
    try:
        library = ctypes.CDLL(str(_build(compiler)))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = e.stderr if isinstance(e, subprocess.CalledProcessError) else e
        log.warning("the CPU decode kernel did not build; keeping the torch path", extra={"error": str(detail)[-2000:]})
        return None
    fn = library.kvd_paged_decode_f32
    fn.restype = ctypes.c_int
    fn.argtypes = [*[_F32P] * 6, _I64, _I64, _I64P, _I64, _I64P, *[_I64] * 5, ctypes.c_float]
    return library


def fits(q: torch.Tensor, layer_k: torch.Tensor) -> bool:
    """Whether this layer's decodes can take the kernel (it is built, and the shapes and dtype are its)."""
    heads, kv_heads, head_dim = q.shape[0], layer_k.shape[2], q.shape[2]
    return (
        q.device.type == "cpu"
        and q.dtype == torch.float32
        and layer_k.dtype == torch.float32
        and heads % kv_heads == 0
        and head_dim % 8 == 0
        and _wanted
        and load() is not None
    )


def _ptr(t: torch.Tensor, kind):
    return ctypes.cast(t.data_ptr(), kind)


def paged_decode(
    queries: torch.Tensor,
    layer_k: torch.Tensor,
    layer_v: torch.Tensor,
    blocks: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one query per sequence over the first ``lens[i]`` positions of its blocks.

    Args:
        queries: ``[B, heads, head_dim]`` float32 (made contiguous here).
        layer_k, layer_v: one layer's cache views ``[blocks, block_size, kv_heads, head_dim]``
            (strided; the head dimension contiguous).
        blocks: ``[B, S]`` int64, each sequence's blocks (padded).
        lens: ``[B]`` int64, each sequence's positions in them.

    Returns:
        The outputs ``[B, heads, head_dim]`` and each head's log-sum-exp of its scaled scores ``[B, heads]``.
    """
    library = load()
    assert library is not None, "check fits() first"
    q = queries.contiguous()
    batch, heads, head_dim = q.shape
    if layer_k.stride() != layer_v.stride() or layer_k.stride(3) != 1 or layer_k.stride(2) != head_dim:
        raise ValueError(f"unexpected cache strides {layer_k.stride()} / {layer_v.stride()}")
    if blocks.dtype != torch.int64 or lens.dtype != torch.int64 or blocks.shape[0] != batch:
        raise ValueError("block ids and lengths must be int64, a row of each per sequence")
    blocks, lens = blocks.contiguous(), lens.contiguous()
    out = torch.empty_like(q)
    running = q.new_empty(2, batch, heads)  # each head's running maximum (then log-sum-exp) and sum of exponentials
    code = library.kvd_paged_decode_f32(
        _ptr(q, _F32P), _ptr(out, _F32P), _ptr(running[0], _F32P), _ptr(running[1], _F32P),
        _ptr(layer_k, _F32P), _ptr(layer_v, _F32P), layer_k.stride(0), layer_k.stride(1),
        _ptr(blocks, _I64P), blocks.shape[1], _ptr(lens, _I64P),
        batch, heads, layer_k.shape[2], head_dim, layer_k.shape[1], scale,
    )  # fmt: skip
    if code:
        raise ValueError(f"shapes the CPU decode kernel cannot take: heads {heads}, kv heads {layer_k.shape[2]}")
    return out, running[0]
