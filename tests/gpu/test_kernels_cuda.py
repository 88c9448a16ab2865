"""CUDA: the Triton kernels compiled for the GPU against the float64 dense
reference of tests/unit/test_kernels.py, in every dtype the engine serves
(bfloat16 cannot be checked in Triton's CPU interpreter) and at the shapes
the interpreter could not vouch for on real hardware: head dim 256 (Gemma 2),
GQA groups that are not powers of two, long contexts with split-KV.

Tolerances (relative error of the whole output): float32 uses IEEE dots, so
far under 1e-4; float16 and bfloat16 operands land between 1e-3 and 1e-2."""

from __future__ import annotations

import math

import pytest
import torch

from inference.kernels.kv_store import store_kv
from inference.kernels.launch import LaunchShape, choose_splits
from inference.kernels.paged_attention import paged_attention
from tests.unit.test_kernels import dense_reference, make_case, relative_error

pytestmark = pytest.mark.gpu

TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 1e-2}
DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
CASES = {
    # (q_len, seq_len) per sequence; decodes alone also run split-KV
    "decodes": [(1, 15), (1, 16), (1, 17), (1, 700), (1, 2001)],
    "mixed": [(1, 47), (7, 17), (1, 1), (3, 3), (200, 1900), (1, 2048)],
}
SHAPES = [(8, 4, 64), (2, 6, 128), (1, 5, 64), (2, 4, 256), (4, 1, 128)]  # (kv_heads, group, head_dim)


def on_cuda(case):
    return tuple(t.cuda() for t in case)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize(("kv_heads", "group", "head_dim"), SHAPES)
def test_paged_attention_on_cuda_matches_float64(case, dtype, kv_heads, group, head_dim):
    lens = CASES[case]
    cache, table, query_start, seq_lens, query = on_cuda(
        make_case(lens, kv_heads, group, head_dim, DTYPES[dtype], seed=len(case) + head_dim)
    )
    layer_k, layer_v = cache[:, 1, 0], cache[:, 1, 1]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    max_q, max_len = max(q for q, _ in lens), max(s for _, s in lens)
    for splits in sorted({1, choose_splits(len(lens), max_q, max_len, kv_heads, sms)}):
        out = torch.full_like(query, math.nan)  # poisoned: every row must be written
        paged_attention(query, layer_k, layer_v, table, query_start, seq_lens, LaunchShape(len(lens), max_q, splits),
                        out=out)  # fmt: skip
        ref = dense_reference(*(t.cpu() for t in (query, layer_k, layer_v, table, query_start, seq_lens)),
                              head_dim**-0.5)  # fmt: skip
        error = relative_error(out.cpu(), ref)
        assert error < TOLERANCE[DTYPES[dtype]], f"{splits} splits: relative error {error:.2e}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_softcap_and_window_on_cuda(dtype):
    lens = [(1, 300), (40, 333), (1, 20)]
    cache, table, query_start, seq_lens, query = on_cuda(make_case(lens, 2, 4, 256, DTYPES[dtype], seed=3))
    layer_k, layer_v = cache[:, 0, 0], cache[:, 0, 1]
    args = (query, layer_k, layer_v, table, query_start, seq_lens)
    out = paged_attention(*args, LaunchShape(3, 40), scale=0.0625, logit_softcap=50.0, sliding_window=64)
    ref = dense_reference(*(t.cpu() for t in args), scale=0.0625, softcap=50.0, window=64)
    assert relative_error(out.cpu(), ref) < TOLERANCE[DTYPES[dtype]]


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_on_cuda_writes_exactly_the_mapped_slots(dtype):
    gen = torch.Generator().manual_seed(1)
    blocks, block, kv_heads, head_dim = 12, 16, 8, 128
    cache = torch.randn(blocks, 2, 2, block, kv_heads, head_dim, generator=gen).to(DTYPES[dtype]).cuda()
    before = cache.clone()
    key = torch.randn(40, kv_heads, head_dim, generator=gen).to(DTYPES[dtype]).cuda()
    value = torch.randn(40, kv_heads, head_dim, generator=gen).to(DTYPES[dtype]).cuda()
    slots = torch.randperm(blocks * block, generator=gen)[:40].to(torch.int32)
    slots[::7] = -1  # not written
    layer_k, layer_v = cache[:, 1, 0], cache[:, 1, 1]
    store_kv(key, value, layer_k, layer_v, slots.cuda())
    expected = before.clone()
    for token, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected[slot // block, 1, 0, slot % block] = key[token]
            expected[slot // block, 1, 1, slot % block] = value[token]
    assert torch.equal(cache, expected)
