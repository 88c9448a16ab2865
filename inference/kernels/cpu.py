"""The engine's C kernels on the CPU (``cpu.c``), built once per machine. All are float32.

- ``paged_decode``: a decode's attention over its own blocks. The torch path
  gathers every sequence's blocks into a contiguous buffer per layer and runs
  torch's fused attention over it: the K/V bytes are read, written and read
  again. This kernel reads them once, where they lie.
- ``prefix_decode``: a decode batch's shared prefix, every query over its
  blocks in place (the prefill kernel's tasks without the causal mask),
  leaving the running softmax state ``paged_decode`` carries on from.
- ``prefill_chunks``: a step's prefill chunks' causal attention,
  flash-attention style, in one call, each chunk's blocks read in place;
  about three times as fast as torch's fused CPU kernel on these shapes.
- ``rms_norm``, ``silu_mul``, ``rotary``: a decoder layer's element-wise
  steps, each one pass over its rows where torch makes several
  (``inference.fused_layers`` puts them in the Llama-code layers).
- ``small_linear``: a linear layer over a few rows (a decode step's tokens),
  its weight packed into panels (``pack_panels``, as wide as the machine's
  vectors: ``panel_width``) read once per call; ``inference.cpu_linear``
  sends batches of up to ``SMALL_ROWS`` rows here and larger ones to oneDNN.

docs/benchmarks.md has the figures. The C source is compiled once per
machine with the C compiler on ``PATH`` (``$CC``, else ``cc``) into
``$XDG_CACHE_HOME/kvd/kernels`` (``-march=native``: the file's name carries a
digest of the source, the flags, the compiler's version and the CPU's
feature flags), then loaded with ctypes, which releases the GIL for the call.
Without a compiler, or when the build fails, ``load`` returns None once and
the engine keeps torch's paths; the engine's ``--no-cpu-kernels`` asks for
those (``use(False)``).
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

from inference import model_store

log = logging.getLogger("inference.kernels.cpu")

SOURCE = Path(__file__).with_name("cpu.c")
#: the most rows ``small_linear`` takes: past ~32 oneDNN's blocked products won on an AVX2
#: box; 16-wide panels beat them further on an AVX-512 one, 8-wide ones did not (docs/benchmarks.md)
SMALL_ROWS = 32
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")
_I64, _F32P = ctypes.c_int64, ctypes.POINTER(ctypes.c_float)
_I64P = ctypes.POINTER(ctypes.c_int64)


def cache_dir() -> Path:
    return model_store.cache_home() / "kernels"


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
    target = cache_dir() / f"cpu-{digest.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Built beside its final name, then renamed: engines starting together never load half a file.
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(built), "-lm"], capture_output=True, check=True)
        os.replace(built, target)
    return target


#: whether the kernels may run (the engine's setting; ``use``)
_wanted = True


def use(wanted: bool) -> bool:
    """Turns the kernels on or off for this process (building them if wanted); returns whether they run."""
    global _wanted
    _wanted = wanted
    return wanted and load() is not None


@functools.cache
def load() -> ctypes.CDLL | None:
    """The built kernels, or None (torch's paths): no compiler, or a failed build."""
    compiler = _compiler()
    if compiler is None:
        log.info("no C compiler: the CPU engine runs torch's paths only")
        return None
    try:
        library = ctypes.CDLL(str(_build(compiler)))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = e.stderr if isinstance(e, subprocess.CalledProcessError) else e
        log.warning("the CPU kernels did not build; keeping torch's paths", extra={"error": str(detail)[-2000:]})
        return None
    fn = library.kvd_paged_decode_f32
    fn.restype = ctypes.c_int
    fn.argtypes = [*[_F32P] * 6, _I64, _I64, _I64P, _I64, _I64P, *[_I64] * 5, ctypes.c_float, ctypes.c_int]
    chunks = library.kvd_prefill_chunks_f32
    chunks.restype = ctypes.c_int
    chunks.argtypes = [ctypes.c_void_p, _I64, _I64, _F32P, _F32P, _I64, _I64, _I64P, _I64, _I64P, _F32P,
                       *[_I64] * 5, ctypes.c_float]  # fmt: skip
    prefix = library.kvd_prefix_decode_f32
    prefix.restype = ctypes.c_int
    prefix.argtypes = [*[_F32P] * 6, _I64, _I64, _I64P, *[_I64] * 7, ctypes.c_float]
    small = library.kvd_small_linear_f32
    small.restype = None
    small.argtypes = [ctypes.c_void_p] * 4 + [_I64] * 3
    library.kvd_rms_norm_f32.restype = None
    library.kvd_rms_norm_f32.argtypes = [ctypes.c_void_p] * 3 + [_I64] * 2 + [ctypes.c_float]
    library.kvd_silu_mul_f32.restype = None
    library.kvd_silu_mul_f32.argtypes = [ctypes.c_void_p] * 2 + [_I64] * 2
    library.kvd_rotary_f32.restype = None
    library.kvd_rotary_f32.argtypes = [ctypes.c_void_p] + [_I64] * 4 + [ctypes.c_void_p] * 2
    # The build's constants, read once here rather than through ctypes on every layer's call.
    library.panel_width = library.kvd_panel_width()
    library.prefill_multiple = library.kvd_prefill_multiple()
    return library


def available() -> bool:
    """Whether the kernels run in this process (built, and not turned off)."""
    return _wanted and load() is not None


def _attention_fits(q: torch.Tensor, kv_dtype: torch.dtype, kv_heads: int, head_multiple) -> bool:
    """Whether an attention kernel runs on these queries ``[heads, tokens, head_dim]``:
    built, float32 on the CPU, whole groups of query heads, ``head_dim`` a multiple
    of ``head_multiple(library)``."""
    heads, head_dim = q.shape[0], q.shape[2]
    return (
        q.device.type == "cpu"
        and q.dtype == torch.float32
        and kv_dtype == torch.float32
        and heads % kv_heads == 0
        and available()
        and head_dim % head_multiple(load()) == 0
    )


def fits(q: torch.Tensor, layer_k: torch.Tensor) -> bool:
    """Whether this layer's decodes can take ``paged_decode`` (it runs, and the shapes and dtype are its)."""
    return _attention_fits(q, layer_k.dtype, layer_k.shape[2], lambda _: 8)


def _ptr(t: torch.Tensor, kind):
    return ctypes.cast(t.data_ptr(), kind)


def _check_cache(layer_k: torch.Tensor, layer_v: torch.Tensor, head_dim: int) -> None:
    if layer_k.stride() != layer_v.stride() or layer_k.stride(3) != 1 or layer_k.stride(2) != head_dim:
        raise ValueError(f"unexpected cache strides {layer_k.stride()} / {layer_v.stride()}")


def paged_decode(
    queries: torch.Tensor,
    layer_k: torch.Tensor,
    layer_v: torch.Tensor,
    blocks: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    prefix: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one query per sequence over the first ``lens[i]`` positions of its blocks.

    Args:
        queries: ``[B, heads, head_dim]`` float32 (made contiguous here).
        layer_k, layer_v: one layer's cache views ``[blocks, block_size, kv_heads, head_dim]``
            (strided; the head dimension contiguous).
        blocks: ``[B, S]`` int64, each sequence's blocks (padded).
        lens: ``[B]`` int64, each sequence's positions in them.
        prefix: :func:`prefix_decode`'s running state over the positions before
            these blocks, which the softmax carries on from (and which is used up).

    Returns:
        The outputs ``[B, heads, head_dim]`` and each head's log-sum-exp of its scaled scores ``[B, heads]``.
    """
    library = load()
    assert library is not None, "check fits() first"
    q = queries.contiguous()
    batch, heads, head_dim = q.shape
    _check_cache(layer_k, layer_v, head_dim)
    if blocks.dtype != torch.int64 or lens.dtype != torch.int64 or blocks.shape[0] != batch:
        raise ValueError("block ids and lengths must be int64, a row of each per sequence")
    blocks, lens = blocks.contiguous(), lens.contiguous()
    # each head's running maximum (then log-sum-exp) and sum of exponentials
    out, running = prefix if prefix is not None else (torch.empty_like(q), q.new_empty(2, batch, heads))
    code = library.kvd_paged_decode_f32(
        _ptr(q, _F32P), _ptr(out, _F32P), _ptr(running[0], _F32P), _ptr(running[1], _F32P),
        _ptr(layer_k, _F32P), _ptr(layer_v, _F32P), layer_k.stride(0), layer_k.stride(1),
        _ptr(blocks, _I64P), blocks.shape[1], _ptr(lens, _I64P),
        batch, heads, layer_k.shape[2], head_dim, layer_k.shape[1], scale, prefix is not None,
    )  # fmt: skip
    if code:
        raise ValueError(f"shapes the decode kernel cannot take: heads {heads}, kv heads {layer_k.shape[2]}")
    return out, running[0]


def paged_fits(q: torch.Tensor, layer_k: torch.Tensor) -> bool:
    """Whether the prefill kernel (``prefill_chunks``, ``prefix_decode``) takes
    these queries and this layer's cache."""
    return _attention_fits(q, layer_k.dtype, layer_k.shape[2], lambda library: library.prefill_multiple)


def prefill_chunks(
    q: torch.Tensor,
    layer_k: torch.Tensor,
    layer_v: torch.Tensor,
    chunks: torch.Tensor,
    tables: torch.Tensor,
    out: torch.Tensor,
    scale: float,
) -> None:
    """A step's prefill chunks' causal attention in one call, each chunk's K/V
    read where they lie through its blocks, written into ``out``.

    Args:
        q: the step's queries ``[heads, tokens, head_dim]`` (strided; the head dimension contiguous).
        layer_k, layer_v: as :func:`paged_decode`'s.
        chunks: ``[n, 4]`` int64: per chunk its first token in ``q`` and ``out``, its
            tokens, its positions (its tokens the last of them), where its blocks start in ``tables``.
        tables: the chunks' block ids, one run after the other (int64).
        out: ``[tokens, heads, head_dim]`` (the head dimension contiguous).
    """
    library = load()
    assert library is not None, "check paged_fits() first"
    heads, _, head_dim = q.shape
    _check_cache(layer_k, layer_v, head_dim)
    if q.stride(-1) != 1 or out.stride(-1) != 1 or out.stride(1) != head_dim:
        raise ValueError(f"unexpected strides: q {q.stride()}, out {out.stride()}")
    if any(t.dtype != torch.int64 or not t.is_contiguous() for t in (chunks, tables)):
        raise ValueError("chunks and tables must be contiguous int64")
    code = library.kvd_prefill_chunks_f32(
        q.data_ptr(), q.stride(0), q.stride(1), _ptr(layer_k, _F32P), _ptr(layer_v, _F32P),
        layer_k.stride(0), layer_k.stride(1), _ptr(chunks, _I64P), chunks.shape[0], _ptr(tables, _I64P),
        _ptr(out, _F32P), out.stride(0), heads, layer_k.shape[2], head_dim, layer_k.shape[1], scale,
    )  # fmt: skip
    if code:
        raise ValueError(f"the prefill kernel refused {chunks.shape[0]} chunks (code {code})")


def prefix_decode(
    queries: torch.Tensor, layer_k: torch.Tensor, layer_v: torch.Tensor, blocks: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The running softmax state of one query per sequence over the prefix they all
    share, its whole ``blocks`` read where they lie: the unnormalized weighted sums
    ``[B, heads, head_dim]`` and each head's maximum and sum of exponentials
    ``[2, B, heads]``, for :func:`paged_decode`'s ``prefix``.

    Args:
        queries: ``[B, heads, head_dim]`` float32 (made contiguous here).
        layer_k, layer_v, scale: as :func:`paged_decode`'s.
        blocks: ``[P]`` int64, the prefix's blocks in position order.
    """
    library = load()
    assert library is not None, "check paged_fits() first"
    q = queries.contiguous()
    batch, heads, head_dim = q.shape
    _check_cache(layer_k, layer_v, head_dim)
    if blocks.dtype != torch.int64:
        raise ValueError("block ids must be int64")
    blocks = blocks.contiguous()
    out, running = torch.empty_like(q), q.new_empty(2, batch, heads)
    code = library.kvd_prefix_decode_f32(
        _ptr(q, _F32P), _ptr(out, _F32P), _ptr(running[0], _F32P), _ptr(running[1], _F32P),
        _ptr(layer_k, _F32P), _ptr(layer_v, _F32P), layer_k.stride(0), layer_k.stride(1),
        _ptr(blocks, _I64P), blocks.shape[0], batch, heads, layer_k.shape[2], head_dim, layer_k.shape[1],
        torch.get_num_threads(), scale,
    )  # fmt: skip
    if code:
        raise ValueError(f"the prefix kernel refused: heads {heads}, kv heads {layer_k.shape[2]} (code {code})")
    return out, running


def panel_width() -> int:
    """The outputs of one of ``small_linear``'s panels: the built kernel's vector width in floats (8 or 16)."""
    library = load()
    assert library is not None, "check available() first"
    return library.panel_width


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """A linear layer's float32 weight ``[N, K]`` (N a multiple of ``panel_width()``, W) as
    ``small_linear``'s panels ``[N / W, K, W]``."""
    out_features, in_features = weight.shape
    width = panel_width()
    if out_features % width or weight.dtype != torch.float32:
        raise ValueError(f"panels take float32 weights with a multiple of {width} outputs, not {tuple(weight.shape)}")
    return weight.detach().view(out_features // width, width, in_features).transpose(1, 2).contiguous()


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as contiguous float32 rows of its last dimension."""
    if x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"the CPU kernels take float32 on the CPU, not {x.dtype} on {x.device}")
    return x.reshape(-1, x.shape[-1]).contiguous()


def small_linear(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x W^T + bias`` for ``x`` of up to ``SMALL_ROWS`` rows (any leading dimensions), W in ``pack_panels``."""
    library = load()
    assert library is not None, "check available() first"
    count, in_features, width = panels.shape
    out_features = count * width
    rows = _rows(x)
    if rows.shape[1] != in_features:
        raise ValueError(f"small_linear takes rows of {in_features}, not {rows.shape[1]}")
    out = rows.new_empty(rows.shape[0], out_features)
    library.kvd_small_linear_f32(
        rows.data_ptr(), panels.data_ptr(), None if bias is None else bias.data_ptr(), out.data_ptr(),
        rows.shape[0], out_features, in_features,
    )  # fmt: skip
    return out.view(*x.shape[:-1], out_features)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dimension (RMSNorm), in a new tensor."""
    rows = _rows(x)
    out = torch.empty_like(rows)
    load().kvd_rms_norm_f32(rows.data_ptr(), weight.data_ptr(), out.data_ptr(), rows.shape[0], rows.shape[1], eps)
    return out.view(x.shape)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up = [..., gate | up]`` (a gated MLP's two
    projections made by one product), in a new tensor of half the width."""
    rows = _rows(gate_up)
    width = rows.shape[1] // 2
    out = rows.new_empty(rows.shape[0], width)
    load().kvd_silu_mul_f32(rows.data_ptr(), out.data_ptr(), rows.shape[0], width)
    return out.view(*gate_up.shape[:-1], width)


def rotary(x: torch.Tensor, heads: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Applies the rotary embedding in place to the first ``heads`` heads of
    each row of ``x`` (``[tokens, width]``, contiguous: a projection's queries,
    then its keys), by each token's ``cos`` and ``sin`` (``[tokens, head_dim]``,
    Hugging Face's convention: ``x cos + rotate_half(x) sin``)."""
    tokens, head_dim = cos.shape
    if not x.is_contiguous() or x.shape[0] != tokens or x.shape[1] < heads * head_dim or head_dim % 2:
        raise ValueError(f"rotary takes contiguous rows of at least {heads} heads of {head_dim}, not {x.shape}")
    cos, sin = _rows(cos), _rows(sin)
    load().kvd_rotary_f32(x.data_ptr(), x.shape[1], tokens, heads, head_dim, cos.data_ptr(), sin.data_ptr())
