"""The torch backend's batched decode plan (``ModelRunner._decode_batch``):
which leading blocks the decodes share and what each keeps as its own."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from inference.model_runner import ModelRunner

BLOCK = 16


def plan(context_lens: list[int], tables: list[list[int]]):
    runner = SimpleNamespace(block_size=BLOCK, device=torch.device("cpu"), kv_cache=torch.zeros(1))
    query_start = list(range(len(context_lens) + 1))  # every chunk one token: all decodes
    return ModelRunner._decode_batch(runner, query_start, context_lens, tables)


def test_decodes_whose_whole_context_is_in_shared_blocks_keep_their_last_block_as_their_own():
    # Greedy forks: the cache gave identical full blocks the same ids, so
    # every table is the same and every context ends on a block boundary.
    batch, rest = plan([32, 32, 32, 32], [[5, 6]] * 4)
    assert rest == []
    assert batch.prefix_blocks.tolist() == [5]
    assert batch.own_blocks.tolist() == [[6]] * 4
    assert (batch.own_mask == 0).all()  # each attends to all 16 positions of its own block


def test_shared_blocks_stop_at_the_first_that_differs():
    batch, _ = plan([40, 36], [[5, 6, 7], [5, 6, 8]])
    assert batch.prefix_blocks.tolist() == [5, 6]
    assert batch.own_blocks.tolist() == [[7], [8]]
    assert torch.isinf(batch.own_mask[1, 4:]).all() and (batch.own_mask[0, :8] == 0).all()
