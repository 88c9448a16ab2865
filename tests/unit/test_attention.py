"""The torch paged attention: what dense causal attention over each sequence's
positions gives, for prefill chunks and decodes, batched or one by one."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

from inference.attention import torch_paged_attention
from inference.model_runner import ModelRunner
from inference.step_inputs import Chunk

BLOCK, LAYERS, KV_HEADS, HEADS, DIM = 4, 2, 2, 6, 8


def runner() -> ModelRunner:
    torch.manual_seed(0)
    cache = torch.randn(64, LAYERS, 2, BLOCK, KV_HEADS, DIM, dtype=torch.float64)
    return ModelRunner(torch.nn.Linear(1, 1).double(), cache, BLOCK)


def inputs(tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    query = torch.randn(1, HEADS, tokens, DIM, dtype=torch.float64, generator=gen)
    new_kv = torch.randn(1, KV_HEADS, tokens, DIM, dtype=torch.float64, generator=gen)
    return query, new_kv


def attend(r: ModelRunner, chunks: list[Chunk], batched: bool, **layer_kwargs) -> torch.Tensor:
    """The paged attention of layer 1; ``layer_kwargs`` as the modeling code
    passes them (``scaling``, ``sliding_window``, ``softcap``)."""
    _, _, meta, _ = r._prepare(chunks)
    if not batched:
        meta = dataclasses.replace(meta, decode=None, looped=None)
    query, new_kv = inputs(meta.query_start[-1])
    layer = types.SimpleNamespace(layer_idx=1)
    return torch_paged_attention(layer, query, new_kv, new_kv, None, attn_metadata=meta, **layer_kwargs)[0]


def dense_reference(
    r: ModelRunner, chunks: list[Chunk], scaling: float = DIM**-0.5, sliding_window=None, softcap=None
) -> torch.Tensor:
    """Each sequence on its own: its cached positions from the cache, its new
    ones from the inputs, softmax(cap(QK^T * scaling) + mask) V per head, the
    mask hiding later positions and those ``sliding_window`` or more before."""
    query, new_kv = inputs(sum(len(c.token_ids) for c in chunks))
    out, start = [], 0
    for c in chunks:
        n = len(c.token_ids)
        length = c.first + n
        slots = [c.block_table[p // BLOCK] * BLOCK + p % BLOCK for p in range(length)]
        new = new_kv[0, :, start : start + n].transpose(0, 1)  # the inputs use one tensor for K and V
        k, v = (r.kv_cache[:, 1, i].flatten(0, 1)[slots].clone() for i in (0, 1))  # [length, kv_heads, dim]
        k[c.first :], v[c.first :] = new, new
        k, v = (t.repeat_interleave(HEADS // KV_HEADS, dim=1).transpose(0, 1) for t in (k, v))  # [heads, length, dim]
        q = query[0, :, start : start + n]  # [heads, n, dim]
        scores = q @ k.transpose(1, 2) * scaling
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        distance = torch.arange(c.first, length)[:, None] - torch.arange(length)[None, :]
        visible = (distance >= 0) & (distance < (sliding_window or length + 1))
        probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
        out.append((probs @ v).transpose(0, 1))
        start += n
    return torch.cat(out)


@pytest.mark.parametrize("batched", [True, False], ids=["batched", "one by one"])
@pytest.mark.parametrize(
    "chunks",
    [
        [Chunk([1, 2, 3, 4, 5, 6], 0, [3, 4], 0, True)],  # a square causal chunk
        [Chunk([1, 2, 3], 5, [3, 4], 5, True), Chunk([4], 9, [5, 6, 7], 9, True)],  # chunk after cached positions
        [Chunk([1], 6, [8, 9], 6, True), Chunk([2], 7, [8, 10], 7, True), Chunk([3, 4], 0, [11], 0, True)],
    ],
    ids=["square", "offset chunk", "decodes and a chunk"],
)
def test_paged_attention_equals_dense_attention(chunks, batched):
    r = runner()
    torch.testing.assert_close(attend(r, chunks, batched)[0], dense_reference(r, chunks), rtol=1e-12, atol=1e-12)


LAYERS_OF_FAMILIES = {
    "sliding window": dict(sliding_window=3),
    "soft-capped, pre-attention scale": dict(scaling=0.3, softcap=0.5),
    "all three": dict(scaling=0.2, sliding_window=5, softcap=1.0),
}


@pytest.mark.parametrize("batched", [True, False], ids=["batched", "one by one"])
@pytest.mark.parametrize("layer", LAYERS_OF_FAMILIES)
@pytest.mark.parametrize("case", ["square", "offset chunk", "decodes and a chunk"])
def test_window_softcap_and_scale_equal_dense_attention(case, layer, batched):
    chunks = {
        "square": [Chunk([1, 2, 3, 4, 5, 6, 7], 0, [3, 4], 0, True)],
        "offset chunk": [Chunk([1, 2, 3], 5, [3, 4], 5, True), Chunk([4], 9, [5, 6, 7], 9, True)],
        "decodes and a chunk": [
            Chunk([1], 12, [8, 9, 12, 13], 12, True),
            Chunk([2], 7, [8, 10], 7, True),
            Chunk([3, 4], 0, [11], 0, True),
        ],
    }[case]
    r = runner()
    kwargs = LAYERS_OF_FAMILIES[layer]
    torch.testing.assert_close(
        attend(r, chunks, batched, **kwargs)[0], dense_reference(r, chunks, **kwargs), rtol=1e-12, atol=1e-12
    )


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
    assert (meta.decode.own_mask == 0).sum(dim=1).tolist() == [2, 6, 1]  # positions 8.., up to each context


def test_very_uneven_decodes_are_not_padded():
    # Padding both short ones to 201 positions would triple the work.
    chunks = [
        Chunk([5], 200, list(range(1, 52)), 200, True),
        Chunk([6], 1, [60], 1, True),
        Chunk([7], 1, [61], 1, True),
    ]
    _, _, meta, _ = runner()._prepare(chunks)
    assert meta.decode is None and meta.looped is None


@pytest.mark.parametrize("name", ["shared prefix", "nothing shared"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_fused_cpu_decodes_equal_the_explicit_products(name, dtype):
    """The CPU's fused kernel (two parts merged by their log-sum-exps) against
    the explicit products the GPU and the capped or windowed layers take."""
    from inference.attention import _attend_decodes_explicit, _attend_decodes_fused
    from inference.attention_metadata import LayerAttention

    r = runner()
    r.kv_cache = r.kv_cache.to(dtype)
    _, _, meta, _ = r._prepare(CASES[name])
    batch = meta.decode
    query, _ = inputs(meta.query_start[-1])
    q = query[0].to(dtype)
    layer_k, layer_v = r.kv_cache[:, 1, 0], r.kv_cache[:, 1, 1]
    layer = LayerAttention(scale=DIM**-0.5, window=None, softcap=None)
    fused = _attend_decodes_fused(q, layer_k, layer_v, batch, layer.scale)
    explicit = _attend_decodes_explicit(q, layer_k, layer_v, batch, layer, None)
    tolerance = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(fused, explicit, rtol=tolerance, atol=tolerance)
    assert bool(batch.prefix_blocks.numel()) == (name == "shared prefix")  # both parts are exercised
