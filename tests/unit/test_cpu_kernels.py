"""The engine's C kernels on the CPU (inference/kernels/cpu.c), built by the
machine's C compiler: the decode kernel reads each sequence's blocks where
they lie and gives what softmax attention over the gathered positions gives,
with each head's log-sum-exp, on its own or carrying on from the prefix
kernel's state over a shared prefix; the prefill kernel gives causal
attention; the small-batch linear gives what torch's linear gives. Without a
compiler the engine keeps torch's paths."""

from __future__ import annotations

import logging
import shutil
import types

import pytest
import torch

from inference.attention import _attend_decodes, torch_paged_attention
from inference.attention_metadata import DecodeBatch, LayerAttention
from inference.cpu_linear import PackedLinear
from inference.kernels import cpu
from inference.model_runner import ModelRunner
from inference.step_inputs import Chunk


def reference(q, layer_k, layer_v, blocks, lens, scale):
    """float64 softmax attention over each sequence's gathered positions: outputs and log-sum-exps."""
    outs, lses = [], []
    group = q.shape[1] // layer_k.shape[2]
    for i, length in enumerate(lens.tolist()):
        k = layer_k[blocks[i]].flatten(0, 1)[:length].double().repeat_interleave(group, dim=1)  # [S, heads, d]
        v = layer_v[blocks[i]].flatten(0, 1)[:length].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,shd->hs", q[i].double(), k) * scale
        outs.append(torch.einsum("hs,shd->hd", scores.softmax(-1), v))
        lses.append(scores.logsumexp(-1))
    return torch.stack(outs), torch.stack(lses)


SHAPES = {
    # heads, kv heads, head dim, block size, each sequence's positions
    "SmolLM2-like, a partial last block": (9, 3, 64, 16, [3, 17, 40, 1]),
    "no grouping, whole blocks": (4, 4, 128, 32, [96, 32, 64, 33]),
    "one position each": (8, 2, 64, 16, [1, 1, 1]),
    "wide groups, tiles within a block": (32, 8, 96, 64, [300, 1]),
}


@pytest.mark.parametrize("sharpness", [1.0, 40.0])
@pytest.mark.parametrize("name", SHAPES)
def test_the_kernel_equals_softmax_attention_over_the_gathered_positions(each_vector_width, name, sharpness):
    """``sharpness`` scales the queries: at 40 most weights are far below
    e^-87, where the kernel's exponential stops following expf."""
    heads, kv_heads, dim, block, lengths = SHAPES[name]
    assert shutil.which("cc"), "the machine's C compiler builds the kernel"
    assert cpu.load() is not None
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(64, 3, 2, block, kv_heads, dim, generator=gen)  # [blocks, layers, K/V, ...]: strided views
    layer_k, layer_v = cache[:, 1, 0], cache[:, 1, 1]
    lens = torch.tensor(lengths)
    width = -(-max(lengths) // block)
    blocks = torch.randperm(64, generator=gen)[: len(lengths) * width].view(len(lengths), width)
    q = torch.randn(len(lengths), heads, dim, generator=gen) * sharpness

    out, lse = cpu.paged_decode(q, layer_k, layer_v, blocks, lens, dim**-0.5)

    want_out, want_lse = reference(q, layer_k, layer_v, blocks, lens, dim**-0.5)
    torch.testing.assert_close(out.double(), want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)


PREFIXES = {
    # heads, kv heads, head dim, block size, prefix blocks, each sequence's own positions
    "SmolLM2-like, 16 decodes": (9, 3, 64, 16, 5, [1, 3, 17, 40] * 4),
    "one decode": (9, 3, 64, 16, 2, [7]),
    "groups of four, head dim 128, blocks of 6": (16, 4, 128, 6, 9, [1, 12, 5]),
    "no grouping, 33 decodes": (4, 4, 64, 16, 3, list(range(1, 34))),
}


@pytest.mark.parametrize("sharpness", [1.0, 40.0])
@pytest.mark.parametrize("name", PREFIXES)
def test_the_decode_kernel_carries_on_from_the_prefix_kernel(each_vector_width, name, sharpness):
    """A shared prefix's state (every query over its blocks, in place), then each
    query's own blocks from it: softmax attention over prefix and own positions."""
    heads, kv_heads, dim, block, num_prefix, lengths = PREFIXES[name]
    gen = torch.Generator().manual_seed(4)
    cache = torch.randn(128, 2, 2, block, kv_heads, dim, generator=gen)
    layer_k, layer_v = cache[:, 1, 0], cache[:, 1, 1]
    ids, lens = torch.randperm(128, generator=gen), torch.tensor(lengths)
    prefix, width = ids[:num_prefix], -(-max(lengths) // block)
    own = ids[num_prefix : num_prefix + len(lengths) * width].view(len(lengths), width)
    q = torch.randn(len(lengths), heads, dim, generator=gen) * sharpness

    state = cpu.prefix_decode(q, layer_k, layer_v, prefix, dim**-0.5)
    out, lse = cpu.paged_decode(q, layer_k, layer_v, own, lens, dim**-0.5, state)

    every_block = torch.cat((prefix.expand(len(lengths), -1), own), dim=1)
    want_out, want_lse = reference(q, layer_k, layer_v, every_block, lens + num_prefix * block, dim**-0.5)
    # scores in the tens carry float32's rounding, summed in another order than the decode kernel's (as in prefill)
    tolerance = 1e-5 if sharpness == 1 else 5e-5
    torch.testing.assert_close(out.double(), want_out, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(lse.double(), want_lse, rtol=tolerance, atol=tolerance)


def test_batched_decodes_take_the_kernel_and_agree_with_the_gathering_path(fresh_build, monkeypatch):
    gen = torch.Generator().manual_seed(1)
    cache = torch.randn(32, 2, 2, 16, 3, 64, generator=gen)
    layer_k, layer_v = cache[:, 0, 0], cache[:, 0, 1]
    lens = torch.tensor([20, 5, 31])
    positions = torch.arange(32)
    batch = DecodeBatch(
        rows=torch.tensor([0, 1, 2]),
        prefix_blocks=torch.tensor([7, 8]),
        own_blocks=torch.tensor([[1, 2], [3, 3], [4, 5]]),
        own_mask=torch.zeros(3, 32).masked_fill_(positions[None, :] >= lens[:, None], float("-inf")),
        own_lens=lens,
    )
    q = torch.randn(9, 3, 64, generator=gen)
    layer = LayerAttention(scale=0.125)
    calls = []
    monkeypatch.setattr(cpu, "paged_decode", lambda *a: calls.append(1) or KERNEL(*a))

    with_kernel = _attend_decodes(q, layer_k, layer_v, batch, layer, None)
    assert calls, "the CPU float32 decodes read their own blocks through the kernel"
    assert not cpu.use(False)  # the engine's --no-cpu-kernels
    gathered = _attend_decodes(q, layer_k, layer_v, batch, layer, None)
    assert len(calls) == 1
    torch.testing.assert_close(with_kernel, gathered, rtol=1e-5, atol=1e-5)


KERNEL = cpu.paged_decode


def causal_reference(q, k, v, scale):
    """float64 attention of the last q_len of k_len positions, each seeing the positions up to its own."""
    q_len, k_len, group = q.shape[1], k.shape[0], q.shape[0] // k.shape[1]
    k, v = (t.double().repeat_interleave(group, dim=1).transpose(0, 1) for t in (k, v))  # [heads, k_len, d]
    scores = q.double() @ k.transpose(1, 2) * scale
    hidden = torch.ones(q_len, k_len, dtype=torch.bool).triu_(k_len - q_len + 1)
    return (scores.masked_fill(hidden, float("-inf")).softmax(-1) @ v).transpose(0, 1)  # [q_len, heads, d]


PREFILLS = {
    # heads, kv heads, head dim, queries, positions
    "SmolLM2-like square chunk": (9, 3, 64, 40, 40),
    "a chunk after cached positions": (9, 3, 64, 21, 150),
    "one query": (9, 3, 64, 1, 77),
    "no grouping, head dim 128": (4, 4, 128, 33, 70),
    "groups of four, tiles of keys cut by the diagonal": (8, 2, 64, 70, 200),
}


@pytest.mark.parametrize("sharpness", [1.0, 40.0])
@pytest.mark.parametrize("name", PREFILLS)
def test_the_prefill_kernel_equals_causal_attention(each_vector_width, name, sharpness):
    heads, kv_heads, dim, q_len, k_len = PREFILLS[name]
    gen = torch.Generator().manual_seed(2)
    tokens = torch.randn(q_len + 3, heads, dim, generator=gen) * sharpness
    q = tokens.transpose(0, 1)[:, 1 : 3 + q_len]  # [heads, q_len + 2, d], strided as the model's queries
    k, v = torch.randn(k_len, kv_heads, dim, generator=gen), torch.randn(k_len, kv_heads, dim, generator=gen)
    layer_k, layer_v, table = paged(k, v, 16, gen)
    out = torch.full((q_len + 2, heads, dim), float("nan"))
    assert cpu.paged_fits(q, layer_k)

    # one chunk: its queries and outputs from token 1 on, its blocks from 0 on in the table
    cpu.prefill_chunks(q, layer_k, layer_v, torch.tensor([[1, q_len, k_len, 0]]), table, out, dim**-0.5)

    # scores in the hundreds carry float32's rounding: torch's own SDPA is 1.9e-5 off on the sharp square chunk
    tolerance = 1e-5 if sharpness == 1 else 5e-5
    want = causal_reference(q[:, 1 : 1 + q_len], k, v, dim**-0.5)
    torch.testing.assert_close(out[1 : 1 + q_len].double(), want, rtol=tolerance, atol=tolerance)
    assert out[0].isnan().all() and out[-1].isnan().all(), "nothing written outside its rows"


def paged(k: torch.Tensor, v: torch.Tensor, block: int, gen) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``k``, ``v`` (``[positions, kv_heads, d]``) laid into a layer's cache of blocks
    in shuffled order (the rest random): its K and V, and the blocks' table in position order."""
    count = -(-k.shape[0] // block)
    cache = torch.randn(count + 3, 2, block, *k.shape[1:], generator=gen)
    table = torch.randperm(count + 3, generator=gen)[:count]
    for half, values in enumerate((k, v)):
        rows = cache[table, half].flatten(0, 1)  # a copy: the blocks' rows in position order
        rows[: values.shape[0]] = values
        cache[table, half] = rows.view(count, block, *values.shape[1:])
    return cache[:, 0], cache[:, 1], table


CHUNKED = {
    # heads, kv heads, head dim, block size, each chunk's (tokens, positions)
    "SmolLM2-like, chunks after a shared prefix": (9, 3, 64, 16, [(48, 640), (48, 640), (1, 1), (17, 33)]),
    "groups of four, head dim 128, blocks of 6": (16, 4, 128, 6, [(70, 70), (5, 200)]),
}


@pytest.mark.parametrize("name", CHUNKED)
def test_the_chunks_kernel_reads_each_chunks_blocks_in_place(each_vector_width, name):
    heads, kv_heads, dim, block, shapes = CHUNKED[name]
    gen = torch.Generator().manual_seed(5)
    cache = torch.randn(160, 2, 2, block, kv_heads, dim, generator=gen)
    layer_k, layer_v = cache[:, 1, 0], cache[:, 1, 1]
    ids = torch.randperm(160, generator=gen)
    tokens = sum(q_len for q_len, _ in shapes)
    q = torch.randn(tokens, heads, dim, generator=gen).transpose(0, 1)  # [heads, tokens, d], strided as the model's
    rows, tables, start, at = [], [], 0, 0
    for q_len, k_len in shapes:
        width = -(-k_len // block)
        rows.append((start, q_len, k_len, at))
        tables.append(ids[at : at + width])
        start, at = start + q_len, at + width
    out = torch.full((tokens, heads, dim), float("nan"))

    cpu.prefill_chunks(q, layer_k, layer_v, torch.tensor(rows), torch.cat(tables), out, dim**-0.5)

    for (start, q_len, k_len, _), table in zip(rows, tables, strict=True):
        k, v = (layer[table].flatten(0, 1)[:k_len] for layer in (layer_k, layer_v))
        want = causal_reference(q[:, start : start + q_len], k, v, dim**-0.5)
        torch.testing.assert_close(out[start : start + q_len].double(), want, rtol=1e-5, atol=1e-5)


def test_prefill_chunks_take_the_kernel_and_agree_with_sdpa(fresh_build, monkeypatch):
    """Through the torch backend: a float32 chunk after cached positions and a
    square one, both in one call reading their blocks in place; a windowed
    layer whose window cuts into the context keeps SDPA for that chunk."""
    cache = torch.randn(32, 2, 2, 16, 3, 64, generator=torch.Generator().manual_seed(3))
    r = ModelRunner(torch.nn.Linear(1, 1), cache, 16)
    chunks = [Chunk(list(range(30)), 40, [1, 2, 3, 4, 5], 40, True), Chunk(list(range(20)), 0, [6, 7], 0, False)]
    _, _, meta, _ = r._prepare(chunks)
    gen = torch.Generator().manual_seed(4)
    query, key = torch.randn(1, 9, 50, 64, generator=gen), torch.randn(1, 3, 50, 64, generator=gen)
    layer = types.SimpleNamespace(layer_idx=1)
    calls = []
    monkeypatch.setattr(cpu, "prefill_chunks", lambda *a: calls.append(a[3].shape[0]) or PREFILL_CHUNKS(*a))

    with_kernel = torch_paged_attention(layer, query, key, key, None, attn_metadata=meta)[0]
    assert calls == [2], "one call for both chunks"
    windowed = torch_paged_attention(layer, query, key, key, None, attn_metadata=meta, sliding_window=50)[0]
    assert calls == [2, 1], "the window cuts into the first chunk's 70 positions, not the second's 20"
    assert not cpu.use(False)
    with_sdpa = torch_paged_attention(layer, query, key, key, None, attn_metadata=meta)[0]
    windowed_sdpa = torch_paged_attention(layer, query, key, key, None, attn_metadata=meta, sliding_window=50)[0]
    assert calls == [2, 1]
    torch.testing.assert_close(with_kernel, with_sdpa, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(windowed, windowed_sdpa, rtol=1e-5, atol=1e-5)


PREFILL_CHUNKS = cpu.prefill_chunks


def test_the_prefill_kernel_leaves_float64_and_unfit_head_dims_to_sdpa(fresh_build):
    # the engine's gate for the prefill kernel's forms (prefill chunks, a decode batch's prefix)
    cache = torch.zeros(4, 1, 2, 16, 2, 64)
    assert cpu.paged_fits(torch.zeros(4, 3, 64), cache[:, 0, 0])
    assert not cpu.paged_fits(torch.zeros(4, 3, 64, dtype=torch.float64), cache[:, 0, 0].double())
    assert not cpu.paged_fits(torch.zeros(4, 3, 24), torch.zeros(4, 16, 2, 24))  # not a multiple of four vectors
    assert not cpu.paged_fits(torch.zeros(4, 3, 24), torch.zeros(4, 16, 2, 24))


def test_float64_and_unfit_head_dims_keep_the_torch_path(fresh_build):
    cache = torch.zeros(4, 1, 2, 16, 2, 64)
    assert cpu.fits(torch.zeros(4, 1, 64), cache[:, 0, 0])
    assert not cpu.fits(torch.zeros(4, 1, 64, dtype=torch.float64), cache[:, 0, 0].double())
    odd = torch.zeros(4, 1, 2, 16, 2, 12)
    assert not cpu.fits(torch.zeros(4, 1, 12), odd[:, 0, 0])


def test_a_failed_build_leaves_the_torch_path_and_says_why(fresh_build, monkeypatch, caplog):
    monkeypatch.setenv("CC", "false")  # a "compiler" that fails every build
    with caplog.at_level(logging.WARNING, logger="inference.kernels.cpu"):
        assert cpu.load() is None
    assert "did not build" in caplog.text
    assert not cpu.fits(torch.zeros(2, 1, 64), torch.zeros(4, 16, 1, 64))


@pytest.mark.parametrize("rows", [1, 3, 8, 16, 21, 32])
@pytest.mark.parametrize("bias", [True, False])
def test_the_small_batch_linear_equals_torchs(each_vector_width, rows, bias):
    # 48 outputs: whole runs of panels; 7 and 8 panels: a last run cut short (runs of 3 panels with
    # AVX-512: 3 + 3 + 1 and 3 + 3 + 2; of 2 without: 2 + 2 + 2 + 1)
    for outputs in (48, 7 * cpu.panel_width(), 8 * cpu.panel_width()):
        gen = torch.Generator().manual_seed(rows)
        linear = torch.nn.Linear(72, outputs, bias=bias)
        with torch.no_grad():
            linear.weight.copy_(torch.randn(outputs, 72, generator=gen))
            if bias:
                linear.bias.copy_(torch.randn(outputs, generator=gen))
        x = torch.randn(1, rows, 72, generator=gen)  # the model's [batch, tokens, features]
        got = cpu.small_linear(x, cpu.pack_panels(linear.weight), linear.bias)
        bias_wanted = linear.bias.double() if bias else None
        want = torch.nn.functional.linear(x.double(), linear.weight.double(), bias_wanted)
        assert got.shape == (1, rows, outputs)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)


def test_a_packed_linear_takes_the_kernel_for_few_rows_and_onednn_for_many(each_vector_width, monkeypatch):
    linear = torch.nn.Linear(64, 48)
    packed = PackedLinear(linear, panels=True)
    calls = []
    real = cpu.small_linear
    monkeypatch.setattr(cpu, "small_linear", lambda *a: calls.append(a[0].shape) or real(*a))
    for rows in (4, cpu.SMALL_ROWS, cpu.SMALL_ROWS + 1, 300):
        x = torch.randn(1, rows, 64)
        torch.testing.assert_close(packed(x), linear(x), rtol=1e-5, atol=1e-4)
    assert calls == [(1, 4, 64), (1, cpu.SMALL_ROWS, 64)]
    assert PackedLinear(torch.nn.Linear(64, 12), panels=True).panels is None  # outputs not a multiple of a panel
