"""CUDA-graph capture driven on the CPU: bucket choice, padding, the static
buffers a replay reads, fall-back to eager, recapture on a new cache.

The graph object is :class:`EagerStandIn` (a replay calls the captured
callable again on the same static buffers); the model is a tiny random
float32 Llama through the Triton backend in Triton's interpreter. A replay
must equal an eager forward of the same padded inputs bitwise (logits and
cache bytes), write no slot but the step's own, and give the torch backend's
greedy tokens. On a GPU, tests/gpu/test_graphs_cuda.py confirms the same
with real graphs.
"""

from __future__ import annotations

import dataclasses
import gc
import weakref

import pytest
import torch

from inference import attention
from inference.cuda_graphs import (
    Bucket,
    EagerStandIn,
    GraphPlan,
    StepGraphs,
    capture_graphs,
    decode_batch_sizes,
    mixed_token_counts,
)
from inference.kernels.launch import LaunchShape
from inference.model_runner import ModelRunner
from inference.step_inputs import Chunk

pytestmark = pytest.mark.needs_triton

BLOCK, LAYERS, KV_HEADS, HEAD_DIM = 16, 2, 2, 16  # tests/model_families.py's tiny_llama
NUM_BLOCKS = 64
#: decode buckets of 2 and 4 sequences, mixed buckets of 8 and 16 tokens over 4 sequences
PLAN = GraphPlan(decode_sizes=(2, 4), mixed_sizes=(8, 16), mixed_seqs=4, max_context=NUM_BLOCKS * BLOCK)
#: 4 multiprocessors: the decode bucket of 2 splits its KV in 2 ranges (for
#: 1,024 positions), though these sequences fill one: the second is empty
SMS = 4


def test_bucket_sizes():
    assert decode_batch_sizes(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert decode_batch_sizes(20) == (1, 2, 4, 8, 16, 20)
    assert decode_batch_sizes(1) == (1,)
    assert mixed_token_counts(512) == (64, 128, 256, 512)
    assert mixed_token_counts(100) == (64, 100)
    assert mixed_token_counts(12) == (12,)
    plan = GraphPlan.for_engine(max_num_seqs=8, token_budget=128, max_context=4096)
    buckets = plan.buckets(lambda seqs: 3)
    assert [(b.tokens, b.seqs, b.logit_rows) for b in buckets] == [
        (1, 1, 1), (2, 2, 2), (4, 4, 4), (8, 8, 8), (64, 8, 8), (128, 8, 8)
    ]  # fmt: skip
    assert buckets[2].launch == LaunchShape(4, 1, 3)  # decode: one query each, a fixed split count
    assert buckets[-1].launch == LaunchShape(8, 128, 1)  # mixed: every sequence, chunks up to the bucket


def decodes(n: int, first: int = 5) -> list[Chunk]:
    return [Chunk([3 + i], first, [i], first, True, f"d{i}") for i in range(n)]


def test_each_step_takes_the_first_bucket_it_fits_or_none():
    cache = torch.zeros(NUM_BLOCKS, 1, 2, BLOCK, 1, 16)
    runner = ModelRunner(torch.nn.Linear(1, 1), cache, BLOCK)
    graphs = StepGraphs(runner, PLAN, EagerStandIn())  # not captured: only its buckets are asked
    assert graphs.width == NUM_BLOCKS  # the longest sequence's blocks

    def bucket(chunks) -> tuple[int, int, int] | None:
        found = graphs.bucket_for(chunks)
        return None if found is None else (found.tokens, found.seqs, found.launch.max_query_len)

    assert bucket(decodes(1)) == (2, 2, 1)
    assert bucket(decodes(3)) == (4, 4, 1)
    prefill = Chunk(list(range(5)), 0, [9], 0, True, "p")
    assert bucket([prefill, *decodes(2)]) == (8, 4, 8)
    assert bucket([Chunk(list(range(9)), 0, [9], 0, True, "p")]) == (16, 4, 16)
    assert bucket([Chunk(list(range(17)), 0, [9, 10], 0, True, "p")]) is None  # more tokens than any bucket
    assert bucket(decodes(5)) is None  # more sequences than any bucket
    assert bucket(decodes(1, first=NUM_BLOCKS * BLOCK)) is None  # longer than the block table


@pytest.fixture(scope="module")
def tiny_llama():
    from tests.model_families import tiny_llama

    attention.choose_backend("torch", "cpu")  # registers every backend
    return tiny_llama()


def new_cache() -> torch.Tensor:
    gen = torch.Generator().manual_seed(3)
    return torch.randn(NUM_BLOCKS, LAYERS, 2, BLOCK, KV_HEADS, HEAD_DIM, generator=gen)


def graphed_runner(model, cache: torch.Tensor, plan: GraphPlan = PLAN) -> tuple[ModelRunner, EagerStandIn]:
    model.set_attn_implementation(attention.BACKENDS["triton"])
    runner = ModelRunner(model, cache, BLOCK)
    runner.num_sms = SMS
    stand_in = EagerStandIn()
    runner.graphs = capture_graphs(runner, plan, stand_in)
    assert runner.graphs is not None and len(stand_in.captured) == len(plan.decode_sizes + plan.mixed_sizes)
    return runner, stand_in


@pytest.fixture(scope="module")
def captured(tiny_llama):
    """A runner with its graphs captured once for the module (its cache is
    reset in place by the tests that need a known start: the graphs keep its address)."""
    return graphed_runner(tiny_llama, new_cache())


def written_slots(chunks: list[Chunk]) -> set[int]:
    return {
        c.block_table[p // BLOCK] * BLOCK + p % BLOCK
        for c in chunks
        for p in range(max(c.first, c.write_from), c.first + len(c.token_ids))
    }


def changed_slots(before: torch.Tensor, after: torch.Tensor) -> set[int]:
    """Slots (block * BLOCK + offset) whose K or V bytes changed in any layer."""
    changed = (before != after).transpose(1, 3).flatten(0, 1).flatten(1).any(dim=1)  # [blocks * BLOCK]
    return set(torch.nonzero(changed).flatten().tolist())


def prompt(seed: int, length: int) -> list[int]:
    return torch.randint(3, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


# A bigger bucket first, then smaller ones: the static buffer still holds the
# bigger step's bytes past what a smaller step copies.
TABLES = {"a": [5, 9], "b": [12], "c": [30, 2]}
STEPS = [
    [Chunk(prompt(1, 10), 0, TABLES["a"], 0, False, "a"), Chunk(prompt(2, 5), 0, TABLES["b"], 0, True, "b")],
    [Chunk([9], 10, TABLES["a"], 10, True, "a"), Chunk([7], 5, TABLES["b"], 5, True, "b"),
     Chunk(prompt(3, 4), 0, TABLES["c"], 0, True, "c")],
    [Chunk([11], 11, TABLES["a"], 11, True, "a"), Chunk([4], 4, TABLES["c"], 4, True, "c")],
    [Chunk([12], 12, TABLES["a"], 12, True, "a"), Chunk([8], 6, TABLES["b"], 6, True, "b"),
     Chunk([5], 5, TABLES["c"], 5, True, "c")],
]  # fmt: skip
BUCKETS = [(16, 4), (8, 4), (2, 2), (4, 4)]  # each step's (tokens, sequences)


def test_replays_equal_eager_forwards_of_the_same_padded_inputs_and_write_only_their_slots(captured):
    runner, stand_in = captured
    cache = runner.kv_cache
    for step, chunks in enumerate(STEPS):
        bucket = runner.graphs.bucket_for(chunks)
        assert (bucket.tokens, bucket.seqs) == BUCKETS[step]
        before, replays = cache.clone(), stand_in.replays
        graphed = runner.forward(chunks).clone()
        after = cache.clone()
        assert stand_in.replays == replays + 1
        assert changed_slots(before, after) == written_slots(chunks), "a padded row wrote into the cache"
        cache.copy_(before)
        eager = runner.graphs.eager(chunks)  # fresh tensors, the same padded inputs and launch shapes
        assert graphed.shape == (sum(c.wants_logits for c in chunks), 256)
        assert torch.equal(graphed, eager), f"step {step}: a replay differs from the eager forward"
        assert torch.equal(cache, after)


def test_greedy_tokens_equal_the_torch_backends(captured, tiny_llama):
    """A prefill step (the 16-token bucket), then decodes that take the
    buckets of 2 (its KV split in 2 ranges) and 4 sequences, against the
    torch backend on its own copy of the cache."""
    runner, stand_in = captured
    runner.kv_cache.copy_(new_cache())
    seqs = {name: prompt(10 + i, n) for i, (name, n) in enumerate([("a", 7), ("b", 3), ("c", 5)])}

    def run(runner: ModelRunner) -> tuple[list[list[int]], list[torch.Tensor]]:
        ids = {name: list(p) for name, p in seqs.items()}
        tokens, logits = [], []
        for step in range(4):
            chunks = [
                Chunk(ids[name][-1:], len(ids[name]) - 1, TABLES[name], len(ids[name]) - 1, True, f"g{name}")
                for name in (["a", "c"] if step == 1 else ids)  # two sequences, then three
            ]  # fmt: skip
            if step == 0:
                chunks = [Chunk(p, 0, TABLES[name], 0, True, f"g{name}") for name, p in ids.items()]
            out = runner.forward(chunks).clone()
            logits.append(out)
            picked = out.argmax(-1).tolist()
            for chunk, token in zip(chunks, picked, strict=True):
                ids[chunk.request_id[1:]].append(token)
            tokens.append(picked)
        return tokens, logits

    replays = stand_in.replays
    graphed_tokens, graphed_logits = run(runner)
    assert stand_in.replays == replays + 4
    assert [b.launch.num_splits for b in runner.graphs.buckets[:2]] == [2, 1]
    tiny_llama.set_attn_implementation(attention.BACKENDS["torch"])
    try:
        torch_tokens, torch_logits = run(ModelRunner(tiny_llama, new_cache(), BLOCK))
    finally:
        tiny_llama.set_attn_implementation(attention.BACKENDS["triton"])
    assert graphed_tokens == torch_tokens
    for have, want in zip(graphed_logits, torch_logits, strict=True):
        torch.testing.assert_close(have, want, rtol=1e-4, atol=1e-4)


def test_steps_outside_every_bucket_run_eagerly(captured):
    runner, stand_in = captured
    cache, replays = runner.kv_cache, stand_in.replays
    too_long = [Chunk(prompt(4, 20), 0, [1, 2], 0, True, "x")]  # 20 tokens: more than the largest bucket
    graphed = runner.forward(too_long).clone()
    assert stand_in.replays == replays
    cache_after = cache.clone()
    graphs, runner.graphs = runner.graphs, None
    try:
        eager = runner.forward(too_long)
    finally:
        runner.graphs = graphs
    assert torch.equal(graphed, eager) and torch.equal(cache, cache_after)
    runner.forward([Chunk([9], 20, [1, 2], 20, True, "x")])  # its next step, a decode, fits a bucket
    assert stand_in.replays == replays + 1


def test_a_new_cache_gets_new_graphs_that_write_it_and_never_the_old_one(captured, tiny_llama):
    """A re-attach: a new runner on a new cache tensor captures again; its
    replays write the new cache, and dropping the runner frees its cache at
    once (nothing in its graphs holds a cycle back to it)."""
    old_runner = captured[0]
    old_bytes = old_runner.kv_cache.clone()
    new = new_cache()
    one_bucket = dataclasses.replace(PLAN, decode_sizes=(), mixed_sizes=(16,))  # what STEPS[0] takes
    new_runner, stand_in = graphed_runner(tiny_llama, new, one_bucket)
    before = new.clone()
    new_runner.forward(STEPS[0])
    assert stand_in.replays == 1
    assert torch.equal(old_runner.kv_cache, old_bytes), "a replay of the new runner wrote the old cache"
    assert changed_slots(before, new) == written_slots(STEPS[0])
    gone = weakref.ref(new)
    gc.disable()
    try:
        del new_runner, stand_in, new
        assert gone() is None, "a dropped runner's graphs kept its cache alive"
    finally:
        gc.enable()


def test_only_the_triton_backend_is_graphed(tiny_llama):
    tiny_llama.set_attn_implementation(attention.BACKENDS["torch"])
    runner = ModelRunner(tiny_llama, new_cache(), BLOCK)
    stand_in = EagerStandIn()
    assert capture_graphs(runner, PLAN, stand_in) is None and not stand_in.captured


def test_bucket_views_cover_the_static_buffer_from_its_start():
    bucket = Bucket(4, 4, 4, LaunchShape(4, 1))
    assert bucket.sizes(width=3) == [4, 4, 4, 5, 4, 4, 12]
