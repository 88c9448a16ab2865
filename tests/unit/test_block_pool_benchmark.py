"""The block-pool benchmark's Step drivers on small workloads, in-process.

The benchmark runs for minutes; these check in about a second that its Step
variants do the work they claim (the same hits and blocks as the manager
variant, every request finished, no block leaked).
"""

import dataclasses
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import block_pool  # noqa: E402
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
