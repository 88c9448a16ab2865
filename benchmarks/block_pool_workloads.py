"""The block-pool benchmark's workloads and request lifecycle, as plain data.

Shared by ``block_pool.py`` (kvd) and ``block_pool_vllm.py`` (vLLM's manager,
run by another virtualenv's python): both build the same seeded prompts and
walk the same schedule, so their figures compare like with like. Standard
library only: the vLLM virtualenv has no kvd.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

BLOCK_SIZE = 16
IN_FLIGHT = 8
VOCAB = 50_000
TOKEN_BUDGET = 4096
#: cold and hot: room for every block of the full workloads (1000 x 128 cold), so nothing is evicted.
NO_EVICT_BLOCKS = 131_072
EVICT_BLOCKS = 4096
NAMES = ("cold", "hot", "evict")


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    num_blocks: int
    params: dict[str, Any]


def random_tokens(rng: random.Random, n: int) -> list[int]:
    return rng.choices(range(VOCAB), k=n)


def build_workload(name: str, num_requests: int, seed: int) -> Workload:
    """cold: 2048 random tokens each; hot: a shared 1536-token prefix + 512
    unique; evict: one of 32 Zipf(1.0) 1024-token prefixes + 1024 unique in a
    pool of 4096 blocks."""
    rng_seed = f"block_pool/{name}/{seed}"
    rng = random.Random(rng_seed)
    params: dict[str, Any] = {"requests": num_requests, "rng_seed": rng_seed}
    if name == "cold":
        prompts = [random_tokens(rng, 2048) for _ in range(num_requests)]
        params.update(prompt_tokens=2048, num_blocks=NO_EVICT_BLOCKS)
        return Workload(name, prompts, NO_EVICT_BLOCKS, params)
    if name == "hot":
        prefix = random_tokens(rng, 1536)
        prompts = [prefix + random_tokens(rng, 512) for _ in range(num_requests)]
        params.update(shared_prefix_tokens=1536, unique_tokens=512, num_blocks=NO_EVICT_BLOCKS)
        return Workload(name, prompts, NO_EVICT_BLOCKS, params)
    assert name == "evict", name
    num_prefixes, zipf_s = 32, 1.0
    prefixes = [random_tokens(rng, 1024) for _ in range(num_prefixes)]
    weights = [1.0 / (k + 1) ** zipf_s for k in range(num_prefixes)]
    picks = rng.choices(range(num_prefixes), weights=weights, k=num_requests)
    prompts = [prefixes[k] + random_tokens(rng, 1024) for k in picks]
    params.update(prefixes=num_prefixes, zipf_s=zipf_s, prefix_tokens=1024, unique_tokens=1024, num_blocks=EVICT_BLOCKS)
    return Workload(name, prompts, EVICT_BLOCKS, params)


def schedule(n: int) -> Iterator[tuple[int | None, list[int], int | None]]:
    """Per step: (request to commit, requests to free, request to admit); n + 1 steps.

    Step i commits request i-1's whole prompt, frees request i-8 and admits
    request i, so 8 requests hold blocks between steps.
    """
    for i in range(n + 1):
        commit = i - 1 if i >= 1 else None
        if i == n:  # the last step frees whoever is left
            yield commit, list(range(max(0, n - IN_FLIGHT), n)), None
        else:
            yield commit, ([i - IN_FLIGHT] if i >= IN_FLIGHT else []), i


@dataclass
class Run:
    """One pass over a workload by one variant."""

    wall_s: float = 0.0
    cpu_s: float = 0.0  # CPU seconds of every process the pass ran in (kvd RPC: client + daemon)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    new_blocks: int = 0
    evictions: int | None = 0
    op_us: dict[str, list[float]] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
