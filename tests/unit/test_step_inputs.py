"""Static step inputs: the padded arrays of a step's chunks, block-table rows
that persist and grow, and the real model through the Triton backend (in
Triton's interpreter) against the torch backend."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from inference import attention
from inference.model_runner import ModelRunner
from inference.step_inputs import BlockTableRows, Chunk, build_step_inputs

BLOCK = 4


def test_arrays_of_a_mixed_step():
    chunks = [
        Chunk([7, 8, 9], 5, [3, 4], 6, True, "a"),  # a chunk after 5 cached positions; position 5 is not rewritten
        Chunk([1], 9, [5, 6, 7], 9, True, "b"),  # a decode
        Chunk([2, 3], 0, [8], 0, False, "c"),  # a prefill chunk that wants no logits
    ]
    rows = BlockTableRows(rows=2, width=1)  # both grow
    assigned = rows.assign(chunks)
    inputs = build_step_inputs(chunks, BLOCK, rows.table, assigned, pad_tokens=8, pad_seqs=4)
    assert inputs.token_ids.tolist() == [7, 8, 9, 1, 2, 3, 0, 0]
    assert inputs.positions.tolist() == [5, 6, 7, 9, 0, 1, 0, 0]
    assert inputs.slot_mapping.tolist() == [-1, 4 * 4 + 2, 4 * 4 + 3, 7 * 4 + 1, 8 * 4, 8 * 4 + 1, -1, -1]
    assert inputs.query_start.tolist() == [0, 3, 4, 6, 6]
    assert inputs.seq_lens.tolist() == [8, 10, 2, 0]
    assert inputs.block_table.tolist() == [[3, 4, 0], [5, 6, 7], [8, 0, 0], [0, 0, 0]]
    assert inputs.logit_rows.tolist() == [2, 3]
    assert (inputs.num_tokens, inputs.num_seqs, inputs.max_query_len, inputs.max_seq_len) == (6, 3, 3, 10)
    assert all(a.dtype == np.int32 for a in (inputs.token_ids, inputs.slot_mapping, inputs.block_table))


def test_prompt_scoring_rows_come_before_each_chunks_sampling_row():
    chunks = [
        Chunk([7, 8, 9], 5, [3, 4], 5, True, "a", prompt_logits=(5, 7)),  # the last chunk: scores, then samples
        Chunk([1], 9, [5, 6, 7], 9, True, "b"),  # a decode
        Chunk([2, 3, 4], 0, [8], 0, False, "c", prompt_logits=(1, 3)),  # a middle chunk scoring from position 1
    ]
    rows = BlockTableRows()
    inputs = build_step_inputs(chunks, BLOCK, rows.table, rows.assign(chunks))
    assert inputs.logit_rows.tolist() == [0, 1, 2, 3, 5, 6]


def test_rows_persist_grow_and_are_given_back():
    rows = BlockTableRows(rows=2, width=2)
    a, b = [1, 2], [3]
    first = rows.assign([Chunk([0], 0, a, 0, True, "a"), Chunk([0], 0, b, 0, True, "b")])
    a.append(4)  # the scheduler's list grows in place
    second = rows.assign([Chunk([0], 0, b, 0, True, "b"), Chunk([0], 0, a, 0, True, "a")])
    assert second == first[::-1]  # same rows, whatever the order
    assert rows.table[second[1], :3].tolist() == [1, 2, 4]
    rows.assign([Chunk([0], 0, a, 0, True, "a")])  # b left: its row is free again
    c = rows.assign([Chunk([0], 0, a, 0, True, "a"), Chunk([0], 0, [9, 9], 0, True, "c")])
    assert c[1] == first[1] and rows.table[c[1], :2].tolist() == [9, 9]
    # Re-admitted after preemption: a new list, even one that agrees with the row's last block.
    again = rows.assign([Chunk([0], 0, [6, 7, 4, 5], 0, True, "a")])
    assert rows.table[again[0], :4].tolist() == [6, 7, 4, 5]


def test_the_runner_copies_one_buffer_and_indexes_logits_on_the_device():
    cache = torch.zeros(16, 1, 2, BLOCK, 1, 8)
    runner = ModelRunner(torch.nn.Linear(1, 1), cache, BLOCK)
    chunks = [Chunk([5, 6], 0, [2], 0, True, "x"), Chunk([4], 3, [1], 3, True, "y")]
    ids, positions, meta, logit_rows = runner._prepare(chunks)
    step = meta.step
    base = ids.untyped_storage().data_ptr()
    for view in (positions, logit_rows, step.slot_mapping, step.query_start, step.seq_lens, step.block_table):
        assert view.untyped_storage().data_ptr() == base  # views of one buffer: one copy on CUDA
    assert logit_rows.tolist() == [1, 2] and step.block_table.tolist() == [[2], [1]]


@pytest.fixture(scope="module")
def smollm(model_dir):
    from inference import model_store

    model = model_store.load_model(model_dir, torch.float32, "cpu")
    # NOTE: its first two layers only: the interpreter takes seconds a layer.
    model.model.layers = model.model.layers[:2]
    model.config.num_hidden_layers = 2
    attention.choose_backend("torch", "cpu")  # registers every backend
    return model


def run(model, backend, cache, steps):
    model.set_attn_implementation(attention.BACKENDS[backend])
    runner = ModelRunner(model, cache, 16)
    return [runner.forward(chunks) for chunks in steps]


@pytest.mark.needs_triton
def test_the_real_model_through_the_triton_backend_matches_torch(smollm):
    """Two prompts prefilled in chunks, then decodes and a chunk in one step."""
    config = smollm.config
    shape = (12, config.num_hidden_layers, 2, 16, config.num_key_value_heads, config.head_dim)
    gen = torch.Generator().manual_seed(0)
    p, q = (
        torch.randint(100, 5000, (40,), generator=gen).tolist(),
        torch.randint(100, 5000, (20,), generator=gen).tolist(),
    )
    tp, tq = [7, 2, 9], [4, 11]
    steps = [
        [Chunk(p[:24], 0, tp, 0, False, "p"), Chunk(q[:17], 0, tq, 0, True, "q")],
        [Chunk(p[24:40], 24, tp, 24, True, "p"), Chunk(q[17:18], 17, tq, 17, True, "q")],
        [Chunk(q[18:20], 18, tq, 18, True, "q"), Chunk([5], 40, tp, 40, True, "p")],
    ]
    torch_cache = torch.randn(shape, generator=gen)
    triton_cache = torch_cache.clone()
    expected = run(smollm, "torch", torch_cache, steps)
    got = run(smollm, "triton", triton_cache, steps)
    for want, have in zip(expected, got, strict=True):
        torch.testing.assert_close(have, want, rtol=1e-4, atol=1e-4)
        assert torch.equal(have.argmax(-1), want.argmax(-1))
    torch.testing.assert_close(triton_cache, torch_cache, rtol=1e-4, atol=1e-4)
