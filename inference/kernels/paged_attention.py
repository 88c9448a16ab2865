"""Paged attention in one launch for a whole step: decodes, prefill chunks, both.

Program ``(seq, q_tile, kv_head * splits + split)`` takes up to ``BLOCK_Q``
consecutive queries of one sequence and packs the ``GROUP`` query heads that
share ``kv_head`` into the rows of one tile, so every K/V tile it loads is
read once for all of them::

    tile row r:  query q_tile * BLOCK_Q + r // GROUP,  head kv_head * GROUP + r % GROUP

It walks the sequence's positions in tiles of ``BLOCK_N`` (32 or 64, whatever the
block size: each position finds its block through the block-table row),
up to the last position its queries see (causal: a chunk's queries are the
last ``q_len`` of ``seq_len`` positions), with an online softmax in float32.
With ``splits > 1`` the positions are cut into that many ranges whose
partial results (unnormalised output, running max, running sum) a second
kernel merges: more programs in flight when a step has few sequences and
long contexts (split-KV).

Tiles (:func:`choose_tiles`): 16-bit inputs go through the tensor cores,
64 query rows for prefill tiles, 16 for decodes; float32 dots are IEEE FMA
loops whose operands all live in registers, so float32 takes 16-row, 32-position
tiles (64-row tiles spilled 14-74 KB per thread to local memory, compiled for
sm_90). Head dims above 128 (above 64 in float32) get 8 warps: with 4 those
tiles spilled too. tests/kernel_compile.py compiles every variant for sm_90
and sm_80 on the CPU and reports registers and spills.

Optional per layer: ``scale`` (default ``head_dim ** -0.5``), ``logit_softcap``
(``cap * tanh(score / cap)``, applied after scaling) and ``sliding_window``
(a query at position p sees positions > p - window).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from inference.kernels.launch import LaunchShape

# A global a kernel reads must be a constexpr: the GPU compiler refuses a
# plain one (the CPU interpreter does not check).
_LOG2E = tl.constexpr(1.4426950408889634)

# NOTE: the step's int32 inputs are views of one packed buffer, so their
# alignment changes with the step's token and sequence counts, as do the
# table width, the split count and the split buffers' outer strides; Triton
# would compile a new variant for each combination it sees. None of them
# feeds a vector load (each is read one scalar or one gather at a time), so
# none is specialized on.
_STEP_POINTERS = ["block_table", "query_start", "seq_lens"]
_STEP_INTS = ["num_splits", "stride_table", "stride_pa_s", "stride_ps_s"]


@dataclass(frozen=True)
class Tiles:
    """One launch's tile sizes: query rows (``block_m``, heads of a group
    packed in), positions per K/V tile (``block_n``), warps per program."""

    block_m: int
    block_n: int
    num_warps: int


def choose_tiles(dtype: torch.dtype, group: int, head_dim: int, decode: bool) -> Tiles:
    """The tiles for a launch (see the module's docstring for why these)."""
    if dtype == torch.float32:
        block_m, block_n = 16, 32
    else:
        block_m, block_n = (16 if decode else 64), 64
    num_warps = 8 if head_dim > (64 if dtype == torch.float32 else 128) else 4
    return Tiles(max(block_m, triton.next_power_of_2(group)), block_n, num_warps)


@triton.jit
def _tanh(x):
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit(do_not_specialize=_STEP_INTS, do_not_specialize_on_alignment=_STEP_POINTERS)
def _paged_attention_kernel(
    q, k_cache, v_cache, out, part_acc, part_stats,
    block_table, query_start, seq_lens,
    scale, softcap, window, num_splits,
    stride_qt, stride_qh, stride_qd,
    stride_ot, stride_oh, stride_od,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_vb, stride_vt, stride_vh, stride_vd,
    stride_table,
    stride_pa_s, stride_pa_t, stride_pa_h,
    stride_ps_s, stride_ps_t, stride_ps_h,
    GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    SPLIT: tl.constexpr, SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    q_tile = tl.program_id(1)
    kv_head = tl.program_id(2) // num_splits
    split = tl.program_id(2) % num_splits

    q_begin = tl.load(query_start + seq)
    q_len = tl.load(query_start + seq + 1) - q_begin
    seq_len = tl.load(seq_lens + seq)
    cached = seq_len - q_len  # positions before this chunk

    rows = tl.arange(0, BLOCK_M)
    q_index = q_tile * BLOCK_Q + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_valid = (rows < BLOCK_Q * GROUP) & (q_index < q_len)
    q_pos = cached + q_index
    dims = tl.arange(0, BLOCK_D)
    dim_valid = dims < HEAD_DIM

    q_ptrs = q + (q_begin + q_index)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :] * stride_qd
    queries = tl.load(q_ptrs, mask=row_valid[:, None] & dim_valid[None, :], other=0.0)

    # The tile's queries see positions [lo, hi); a tile past the chunk sees none.
    tile_first = cached + q_tile * BLOCK_Q
    hi = tl.minimum(tile_first + BLOCK_Q, seq_len)
    hi = hi * (q_tile * BLOCK_Q < q_len).to(tl.int32)
    lo = 0
    if WINDOW:
        lo = tl.maximum(tile_first - window + 1, 0) // BLOCK_N * BLOCK_N
    if SPLIT:
        per_split = tl.cdiv(tl.cdiv(hi - lo, BLOCK_N), num_splits) * BLOCK_N
        lo = lo + split * per_split
        hi = tl.minimum(hi, lo + per_split)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    offsets = tl.arange(0, BLOCK_N)

    for start in range(lo, hi, BLOCK_N):
        pos = start + offsets
        blocks = tl.load(block_table + seq * stride_table + pos // BLOCK_SIZE, mask=pos < hi, other=0)
        blocks = blocks.to(tl.int64)[:, None]
        in_block = (pos % BLOCK_SIZE).to(tl.int64)[:, None]
        kv_mask = (pos < hi)[:, None] & dim_valid[None, :]
        k_ptrs = k_cache + blocks * stride_kb + in_block * stride_kt + kv_head * stride_kh
        keys = tl.load(k_ptrs + dims[None, :] * stride_kd, mask=kv_mask, other=0.0)
        scores = tl.dot(queries, tl.trans(keys), input_precision=PRECISION) * scale
        if SOFTCAP:
            scores = softcap * _tanh(scores / softcap)
        visible = pos[None, :] <= q_pos[:, None]
        if WINDOW:
            visible = visible & (pos[None, :] > q_pos[:, None] - window)
        scores = tl.where(visible, scores * _LOG2E, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet
        probs = tl.exp2(scores - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(probs, 1)
        v_ptrs = v_cache + blocks * stride_vb + in_block * stride_vt + kv_head * stride_vh
        values = tl.load(v_ptrs + dims[None, :] * stride_vd, mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(probs.to(values.dtype), values, input_precision=PRECISION)
        m_i = m_new

    token = q_begin + q_index
    store_mask = row_valid[:, None] & dim_valid[None, :]
    if SPLIT:
        pa = part_acc + split * stride_pa_s + token[:, None] * stride_pa_t + head[:, None] * stride_pa_h
        tl.store(pa + dims[None, :], acc, mask=store_mask)
        ps = part_stats + split * stride_ps_s + token * stride_ps_t + head * stride_ps_h
        tl.store(ps, m_i, mask=row_valid)
        tl.store(ps + 1, l_i, mask=row_valid)
    else:
        o_ptrs = out + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :] * stride_od
        norm = tl.where(l_i == 0.0, 1.0, l_i)  # rows outside the chunk: never stored
        tl.store(o_ptrs, (acc / norm[:, None]).to(out.dtype.element_ty), mask=store_mask)


@triton.jit(do_not_specialize=["num_splits", "stride_pa_s", "stride_ps_s"])
def _merge_splits_kernel(
    out, part_acc, part_stats, num_splits,
    stride_ot, stride_oh, stride_od,
    stride_pa_s, stride_pa_t, stride_pa_h,
    stride_ps_s, stride_ps_t, stride_ps_h,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0)
    head = tl.program_id(1)
    dims = tl.arange(0, BLOCK_D)
    stats = part_stats + token * stride_ps_t + head * stride_ps_h
    m = tl.load(stats)
    for split in range(1, num_splits):
        m = tl.maximum(m, tl.load(stats + split * stride_ps_s))
    total = tl.zeros([BLOCK_D], tl.float32)
    norm = 0.0
    for split in range(0, num_splits):
        m_s = tl.load(stats + split * stride_ps_s)
        weight = tl.where(m_s == float("-inf"), 0.0, tl.exp2(m_s - m))  # an empty range adds nothing
        norm += weight * tl.load(stats + split * stride_ps_s + 1)
        part = part_acc + split * stride_pa_s + token * stride_pa_t + head * stride_pa_h
        total += weight * tl.load(part + dims, mask=dims < HEAD_DIM, other=0.0)
    o_ptrs = out + token * stride_ot + head * stride_oh + dims * stride_od
    tl.store(o_ptrs, (total / norm).to(out.dtype.element_ty), mask=dims < HEAD_DIM)


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start: torch.Tensor,
    seq_lens: torch.Tensor,
    shape: LaunchShape,
    scale: float | None = None,
    logit_softcap: float | None = None,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of every step token over its sequence's paged K/V.

    Args:
        query: ``[tokens, heads, head_dim]``, any strides.
        k_cache, v_cache: one layer's views ``[blocks, block_size, kv_heads, head_dim]``.
        block_table: ``[>= num_seqs, width]`` int32, sequence i's blocks in row i.
        query_start: ``[num_seqs + 1]`` int32, where each sequence's tokens start.
        seq_lens: ``[num_seqs]`` int32, each sequence's positions after this step.
        shape: the launch's host-side sizes.

    Returns:
        ``[tokens, heads, head_dim]`` (``out`` when given); the rows of
        tokens outside every sequence (padding) hold no meaningful values.
    """
    tokens, heads, head_dim = query.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    tiles = choose_tiles(query.dtype, group, head_dim, decode=shape.max_query_len == 1)
    block_q = tiles.block_m // group
    block_d = max(16, triton.next_power_of_2(head_dim))
    splits = shape.num_splits
    if out is None:
        out = torch.empty(tokens, heads, head_dim, dtype=query.dtype, device=query.device)
    if splits > 1:
        part_acc = torch.empty(splits, tokens, heads, block_d, dtype=torch.float32, device=query.device)
        part_stats = torch.empty(splits, tokens, heads, 2, dtype=torch.float32, device=query.device)
    else:  # unused: any tensor with the right number of strides
        part_acc = part_stats = out
    precision = "tf32" if query.dtype in (torch.float16, torch.bfloat16) else "ieee"  # tf32: unused for 16-bit inputs
    grid = (shape.num_seqs, triton.cdiv(shape.max_query_len, block_q), kv_heads * splits)
    _paged_attention_kernel[grid](
        query, k_cache, v_cache, out, part_acc, part_stats,
        block_table, query_start, seq_lens,
        head_dim**-0.5 if scale is None else scale, logit_softcap or 0.0, sliding_window or 0, splits,
        *query.stride(), *out.stride(), *k_cache.stride(), *v_cache.stride(), block_table.stride(0),
        *part_acc.stride()[:3], *part_stats.stride()[:3],
        GROUP=group, BLOCK_Q=block_q, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_SIZE=block_size,
        SPLIT=splits > 1, SOFTCAP=bool(logit_softcap), WINDOW=bool(sliding_window), PRECISION=precision,
        num_warps=tiles.num_warps,
    )  # fmt: skip
    if splits > 1:
        _merge_splits_kernel[(tokens, heads)](
            out, part_acc, part_stats, splits,
            *out.stride(), *part_acc.stride()[:3], *part_stats.stride()[:3],
            HEAD_DIM=head_dim, BLOCK_D=block_d,
        )  # fmt: skip
    return out
