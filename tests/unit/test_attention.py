"""The torch paged attention: batched decodes give what one-by-one attention gives."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

from inference.attention import torch_paged_attention
from inference.model_runner import Chunk, ModelRunner

BLOCK, LAYERS, KV_HEADS, HEADS, DIM = 4, 2, 2, 6, 8


def runner() -> ModelRunner:
    torch.manual_seed(0)
    cache = torch.randn(64, LAYERS, 2, BLOCK, KV_HEADS, DIM, dtype=torch.float64)
    return ModelRunner(torch.nn.Linear(1, 1).double(), cache, BLOCK)


def attend(r: ModelRunner, chunks: list[Chunk], batched: bool) -> torch.Tensor:
    _, _, meta, _ = r._prepare(chunks)
    if not batched:
        meta = dataclasses.replace(meta, decode=None, looped=None)
    tokens = meta.query_start[-1]
    gen = torch.Generator().manual_seed(1)
    query = torch.randn(1, HEADS, tokens, DIM, dtype=torch.float64, generator=gen)
    new_kv = torch.randn(1, KV_HEADS, tokens, DIM, dtype=torch.float64, generator=gen)
    layer = types.SimpleNamespace(layer_idx=1)
    return torch_paged_attention(layer, query, new_kv, new_kv, None, attn_metadata=meta)[0]


CASES = {
    # Three decodes sharing blocks 1, 2 (positions 0-7), then blocks of their own.
    "shared prefix": [
        Chunk([5], 9, [1, 2, 3], 9, True),
        Chunk([6], 13, [1, 2, 4, 5], 13, True),
        Chunk([7], 8, [1, 2, 6], 8, True),
    ],
    "nothing shared": [Chunk([5], 6, [7, 8], 6, True), Chunk([6], 3, [9], 3, True)],
    "decodes beside a prefill chunk": [
        Chunk([1, 2, 3, 4, 5], 2, [10, 11], 2, True),
        Chunk([5], 9, [1, 2, 3], 9, True),
        Chunk([6], 10, [1, 2, 12], 10, True),
    ],
}


@pytest.mark.parametrize("name", CASES)
def test_batched_decodes_equal_one_by_one(name):
    chunks = CASES[name]
    r = runner()
    _, _, meta, _ = r._prepare(chunks)
    assert meta.decode is not None  # the case exercises the batched path
    batched = attend(runner(), chunks, batched=True)
    looped = attend(runner(), chunks, batched=False)
    torch.testing.assert_close(batched, looped, rtol=1e-12, atol=1e-12)


def test_the_shared_prefix_is_the_common_leading_blocks():
    _, _, meta, _ = runner()._prepare(CASES["shared prefix"])
    assert meta.decode.prefix_blocks.tolist() == [1, 2]
    assert meta.decode.own_valid.sum(dim=1).tolist() == [2, 6, 1]  # positions 8.., up to each context


def test_very_uneven_decodes_are_not_padded():
    # Padding both short ones to 201 positions would triple the work.
    chunks = [
        Chunk([5], 200, list(range(1, 52)), 200, True),
        Chunk([6], 1, [60], 1, True),
        Chunk([7], 1, [61], 1, True),
    ]
    _, _, meta, _ = runner()._prepare(chunks)
    assert meta.decode is None and meta.looped is None
