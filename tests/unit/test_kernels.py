"""The Triton kernels against a float64 dense reference, in Triton's
interpreter on CPU tensors (``TRITON_INTERPRET=1``, set by tests/conftest.py
without CUDA): shuffled block tables, lengths at block boundaries +-1, mixes
of decodes and chunks after cached positions, GQA ratios 1/4/8, head dims
64/128, split-KV, sliding windows, soft-capping. Sizes are small: the
interpreter runs each program in numpy."""

from __future__ import annotations

import math

import pytest
import torch

from inference.kernels.kv_store import store_kv
from inference.kernels.launch import LaunchShape
from inference.kernels.paged_attention import paged_attention

pytestmark = pytest.mark.needs_triton

BLOCK = 16
TOLERANCE = {torch.float32: 1e-5, torch.float16: 5e-3}


def make_case(lens, kv_heads, group, head_dim, dtype, seed, block=BLOCK):
    """A cache with shuffled blocks and, per sequence, (q_len, seq_len)."""
    gen = torch.Generator().manual_seed(seed)
    widths = [-(-seq_len // block) for _, seq_len in lens]
    num_blocks = sum(widths) + 3
    cache = torch.randn(num_blocks, 2, 2, block, kv_heads, head_dim, generator=gen).to(dtype)
    order = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    table = torch.zeros(len(lens), max(widths), dtype=torch.int32)
    used = 0
    for row, width in enumerate(widths):
        table[row, :width] = order[used : used + width]
        used += width
    q_lens = torch.tensor([q for q, _ in lens])
    query_start = torch.cat((torch.zeros(1, dtype=torch.int64), q_lens.cumsum(0))).to(torch.int32)
    seq_lens = torch.tensor([s for _, s in lens], dtype=torch.int32)
    query = torch.randn(int(q_lens.sum()), kv_heads * group, head_dim, generator=gen).to(dtype)
    return cache, table, query_start, seq_lens, query


def dense_reference(query, layer_k, layer_v, table, query_start, seq_lens, scale, softcap=None, window=None):
    """softmax(scale * QK^T (+ cap, window, causal mask)) V per sequence, in float64."""
    heads, block, kv_heads = query.shape[1], layer_k.shape[1], layer_k.shape[2]
    out = []
    for row, seq_len in enumerate(seq_lens.tolist()):
        start, end = query_start[row].item(), query_start[row + 1].item()
        blocks = table[row, : -(-seq_len // block)].long()
        k, v = (
            c[blocks].flatten(0, 1)[:seq_len].double().repeat_interleave(heads // kv_heads, 1)
            for c in (layer_k, layer_v)
        )
        q = query[start:end].double()
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        q_pos = torch.arange(seq_len - (end - start), seq_len)[:, None]
        visible = torch.arange(seq_len)[None, :] <= q_pos
        if window:
            visible &= torch.arange(seq_len)[None, :] > q_pos - window
        probs = scores.masked_fill(~visible, -math.inf).softmax(-1)
        out.append(torch.einsum("hqk,khd->qhd", probs, v))
    return torch.cat(out)


def relative_error(out, ref):
    assert torch.isfinite(out).all(), "a row was not written or is not finite"
    return ((out.double() - ref).norm() / ref.norm()).item()


CASES = {
    # (q_len, seq_len) per sequence
    "decodes at block boundaries": [(1, 15), (1, 16), (1, 17), (1, 33)],
    "chunks after cached positions": [(5, 31), (16, 32), (3, 3)],
    "mixed": [(1, 47), (7, 17), (1, 1), (12, 12)],
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize(("kv_heads", "group", "head_dim"), [(2, 1, 64), (1, 4, 128), (1, 8, 64)])
def test_paged_attention_matches_dense(case, dtype, kv_heads, group, head_dim):
    lens = CASES[case]
    cache, table, query_start, seq_lens, query = make_case(lens, kv_heads, group, head_dim, dtype, seed=len(case))
    layer_k, layer_v = cache[:, 1, 0], cache[:, 1, 1]
    launch = LaunchShape(len(lens), max(q for q, _ in lens))
    out = torch.full_like(query, math.nan)  # poisoned: every row must be written
    paged_attention(query, layer_k, layer_v, table, query_start, seq_lens, launch, out=out)
    ref = dense_reference(query, layer_k, layer_v, table, query_start, seq_lens, head_dim**-0.5)
    assert relative_error(out, ref) < TOLERANCE[dtype]


@pytest.mark.parametrize("block", [32, 48])
def test_other_block_sizes(block):
    lens = [(1, block - 1), (1, block + 1), (6, 2 * block + 5)]  # tiles of 64 positions span blocks
    cache, table, query_start, seq_lens, query = make_case(lens, 2, 4, 64, torch.float32, seed=block, block=block)
    layer_k, layer_v = cache[:, 1, 0], cache[:, 1, 1]
    out = paged_attention(query, layer_k, layer_v, table, query_start, seq_lens, LaunchShape(3, 6))
    ref = dense_reference(query, layer_k, layer_v, table, query_start, seq_lens, 64**-0.5)
    assert relative_error(out, ref) < 1e-5


@pytest.mark.parametrize("splits", [2, 3])
def test_split_kv_merges_to_the_same_result(splits):
    lens = [(1, 200), (1, 17), (1, 1)]  # 4, 1 and 1 tiles of 64: a split may get no positions at all
    cache, table, query_start, seq_lens, query = make_case(lens, 2, 4, 64, torch.float32, seed=7)
    layer_k, layer_v = cache[:, 0, 0], cache[:, 0, 1]
    out = paged_attention(query, layer_k, layer_v, table, query_start, seq_lens, LaunchShape(3, 1, splits))
    ref = dense_reference(query, layer_k, layer_v, table, query_start, seq_lens, 64**-0.5)
    assert relative_error(out, ref) < 1e-5


def test_a_split_count_fixed_for_the_longest_context_is_right_for_every_length():
    """A CUDA graph's decode bucket keeps one split count, chosen for the
    model's longest context: shorter sequences leave most ranges empty."""
    lens = [(1, 1), (1, 63), (1, 64), (1, 65), (1, 130)]
    cache, table, query_start, seq_lens, query = make_case(lens, 1, 4, 64, torch.float32, seed=11)
    layer_k, layer_v = cache[:, 0, 0], cache[:, 0, 1]
    out = paged_attention(query, layer_k, layer_v, table, query_start, seq_lens, LaunchShape(5, 1, 8))
    ref = dense_reference(query, layer_k, layer_v, table, query_start, seq_lens, 64**-0.5)
    assert relative_error(out, ref) < 1e-5


def test_scale_softcap_and_sliding_window():
    lens = [(1, 40), (9, 33)]
    cache, table, query_start, seq_lens, query = make_case(lens, 1, 4, 64, torch.float32, seed=3)
    layer_k, layer_v = cache[:, 0, 0], cache[:, 0, 1]
    args = (query, layer_k, layer_v, table, query_start, seq_lens, LaunchShape(2, 9))
    out = paged_attention(*args, scale=0.3, logit_softcap=5.0, sliding_window=20)
    ref = dense_reference(*args[:-1], scale=0.3, softcap=5.0, window=20)
    assert relative_error(out, ref) < 1e-5
    assert relative_error(paged_attention(*args), ref) > 1e-2  # the options do change the result


def test_padding_sequences_and_tokens_are_ignored():
    lens = [(2, 20), (1, 5)]
    cache, table, query_start, seq_lens, query = make_case(lens, 1, 4, 64, torch.float32, seed=5)
    layer_k, layer_v = cache[:, 0, 0], cache[:, 0, 1]
    ref = dense_reference(query, layer_k, layer_v, table, query_start, seq_lens, 64**-0.5)
    # Two padding sequences (no tokens, length 0) and two padding tokens.
    padded_query = torch.cat((query, torch.randn(2, *query.shape[1:])))
    padded_start = torch.cat((query_start, query_start[-1:].repeat(2)))
    padded_lens = torch.cat((seq_lens, torch.zeros(2, dtype=torch.int32)))
    padded_table = torch.cat((table, torch.zeros(2, table.shape[1], dtype=torch.int32)))
    out = paged_attention(padded_query, layer_k, layer_v, padded_table, padded_start, padded_lens, LaunchShape(4, 2))
    assert relative_error(out[: len(query)], ref) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
def test_store_kv_writes_slots_through_the_cache_strides(dtype):
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(6, 3, 2, BLOCK, 2, 64, generator=gen).to(dtype)
    before = cache.clone()
    key = torch.randn(1, 2, 4, 64, generator=gen).to(dtype)  # the model's [1, kv_heads, tokens, dim]
    value = torch.randn(1, 2, 4, 64, generator=gen).to(dtype)
    slots = torch.tensor([5 * BLOCK + 3, -1, 0, 2 * BLOCK + BLOCK - 1], dtype=torch.int32)
    store_kv(key[0].transpose(0, 1), value[0].transpose(0, 1), cache[:, 1, 0], cache[:, 1, 1], slots)
    expected = before.clone()
    for token, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected[slot // BLOCK, 1, 0, slot % BLOCK] = key[0, :, token]
            expected[slot // BLOCK, 1, 1, slot % BLOCK] = value[0, :, token]
    assert torch.equal(cache, expected)  # the written slots, and nothing else


def test_the_triton_backend_is_the_gpu_default_and_says_what_block_sizes_it_needs():
    from inference import attention

    assert attention.choose_backend("auto", "cpu") == "torch"
    with pytest.raises(ValueError, match="triton"):
        attention.choose_backend("triton", "cpu")
    assert attention.block_size_fits("triton", 48) and not attention.block_size_fits("triton", 8)
    assert "multiple of 16" in attention.block_size_message("triton", 8)
