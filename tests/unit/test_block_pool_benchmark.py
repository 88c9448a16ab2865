"""The block-pool benchmark's Step drivers on small workloads, in-process.

The benchmark runs for minutes; these check in about a second that its Step
variants do the work they claim (the same hits and blocks as the manager
variant, every request finished, no block leaked) and that its waiting
workload sends and hashes each prompt once.
"""

import dataclasses
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import block_pool  # noqa: E402
import block_pool_waiting as waiting  # noqa: E402
import block_pool_workloads as wl  # noqa: E402


def small(name: str, num_requests: int) -> wl.Workload:
    """A workload of the benchmark's, its pool no larger than evict's (a 131k-block pool takes seconds to build)."""
    w = wl.build_workload(name, num_requests, seed=0)
    return dataclasses.replace(w, num_blocks=min(w.num_blocks, wl.EVICT_BLOCKS))


@pytest.mark.parametrize("name", ["hot", "evict"])
def test_one_step_per_request_matches_the_manager(name):
    w = small(name, 48)  # evict: past its 4096 blocks
    manager = block_pool.run_manager(w, name)
    steps = block_pool.run_steps_inprocess(w, name)  # asserts that no block leaked
    assert manager.cached_tokens > 0
    assert (steps.cached_tokens, steps.new_blocks, steps.evictions) == (
        manager.cached_tokens,
        manager.new_blocks,
        manager.evictions,
    )
    assert len(steps.op_us["step"]) == 48
    if name == "evict":
        assert manager.evictions > 0


def test_batched_steps_finish_every_request_with_the_same_hits():
    w = small("hot", 40)
    manager = block_pool.run_manager(w, "hot")
    batched = block_pool.run_steps_inprocess(w, "hot", batched=True)
    # The first batch shares a new prefix: 7 of its 8 wait for the first to
    # compute it, then hit it like every later request.
    assert batched.extra["deferred_admissions"] >= 7
    assert batched.cached_tokens == manager.cached_tokens
    assert 40 // wl.IN_FLIGHT < batched.extra["steps"] <= 40 // wl.IN_FLIGHT + 3


def test_waiting_requests_are_sent_and_hashed_once():
    shape = waiting.Shape(
        requests=24,
        prompt_tokens=160,
        pool_requests=4,
        max_new_tokens=4,
        token_budget=192,
        warmup_steps=8,
    )
    run = waiting.run_inprocess(shape, steps=24, seed=0)
    summary = waiting.summarize([run], shape)
    blocks_per_prompt = shape.prompt_tokens // wl.BLOCK_SIZE
    # 4 sampled tokens never fill a block: every hash is a prompt block, once.
    assert sum(run.hashes) == summary["arrival_step_hashes"] == shape.requests * blocks_per_prompt
    assert summary["hashes_per_step"] == 0
    prompt_bytes = 2 * shape.prompt_tokens  # token ids of up to 50,000 take 2-3 bytes each
    assert summary["arrival_step_request_bytes"] > shape.requests * prompt_bytes
    assert summary["request_bytes_per_step_max"] < prompt_bytes  # no prompt is sent again
    assert summary["admitted_steady"] > 0 and summary["waiting_requests_steady_min"] < shape.requests - 4
