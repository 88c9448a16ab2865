"""The block-pool benchmark's ``waiting`` workload: a long queue at a full pool.

256 requests of 8,000 tokens arrive at once at an engine whose daemon pool
holds 16 of them. The engine's own scheduler (``inference.scheduler``) builds
every Step, and a stand-in for the model computes each chunk it is given and
samples one token where a chunk wants logits; requests finish after 64 tokens
and free their blocks, and the next waiting one takes their place. The token
budget holds one whole prompt, so the pool is full after about 16 Steps; the
Steps after ``WARMUP_STEPS`` are the steady state (a full pool, ~240 waiting).

What is measured per Step: its latency, the bytes of the request on the wire
and the SHA-256 block hashes the daemon computes (counted in-process, where
the same code runs as in the daemon: the hash function is wrapped). The
arrival Step (the first) is reported on its own.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import block_pool_workloads as wl

import kvd.hashing
from inference.sampling import SamplingParams
from inference.scheduler import Scheduler
from inference.sequence import Finish, Sequence, Status
from kvd.step import StepInput, StepOutput

NUM_REQUESTS = 256
PROMPT_TOKENS = 8000
POOL_REQUESTS = 16  # the pool holds this many whole requests
MAX_NEW_TOKENS = 64
MAX_NUM_SEQS = 64  # the engine's default (inference/engine.py EngineConfig)
TOKEN_BUDGET = 8192  # one whole prompt per Step, so the pool fills in ~16 Steps
WARMUP_STEPS = 24


def num_blocks() -> int:
    return POOL_REQUESTS * -(-(PROMPT_TOKENS + MAX_NEW_TOKENS) // wl.BLOCK_SIZE)


def params(steps: int) -> dict[str, Any]:
    return {
        "requests": NUM_REQUESTS,
        "prompt_tokens": PROMPT_TOKENS,
        "num_blocks": num_blocks(),
        "pool_holds_requests": POOL_REQUESTS,
        "max_new_tokens": MAX_NEW_TOKENS,
        "max_num_seqs": MAX_NUM_SEQS,
        "token_budget": TOKEN_BUDGET,
        "warmup_steps": WARMUP_STEPS,
        "steady_steps": steps,
        "scheduler": "inference.scheduler.Scheduler (what the engine sends)",
    }


@dataclass
class WaitingRun:
    step_ms: list[float] = field(default_factory=list)
    request_bytes: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)
    waiting: list[int] = field(default_factory=list)
    # per step: (scheduled, admitted, preempted, free blocks after it)
    trace: list[tuple[int, int, int, int]] = field(default_factory=list)
    daemon_cpu_s: float | None = None  # the daemon process's CPU over the steady Steps (RPC only)


class HashCounter:
    """Counts SHA-256 block hashes by wrapping the hashing module's function."""

    def __init__(self) -> None:
        self.count = 0

    @contextmanager
    def installed(self) -> Iterator[HashCounter]:
        original = kvd.hashing._sha256

        def counting(data: bytes):
            self.count += 1
            return original(data)

        kvd.hashing._sha256 = counting
        try:
            yield self
        finally:
            kvd.hashing._sha256 = original


def run(
    step_fn: Callable[[StepInput], StepOutput],
    steps: int,
    seed: int,
    request_bytes: Callable[[StepInput], int] | None = None,
    hashes: HashCounter | None = None,
    daemon_cpu_s: Callable[[], float] | None = None,
) -> WaitingRun:
    """All requests arrive, then ``WARMUP_STEPS + steps`` engine steps, each measured."""
    rng = random.Random(f"block_pool/waiting/{seed}")
    scheduler = Scheduler(MAX_NUM_SEQS, TOKEN_BUDGET)
    sampling = SamplingParams(max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    for i in range(NUM_REQUESTS):
        scheduler.add(Sequence(f"w{i}", wl.random_tokens(rng, PROMPT_TOKENS), sampling))
    out = WaitingRun()
    for index in range(WARMUP_STEPS + steps):
        if daemon_cpu_s is not None and index == WARMUP_STEPS:
            out.daemon_cpu_s = -daemon_cpu_s()
        step = scheduler.build_step()
        out.waiting.append(len(scheduler.waiting))
        hashed_before = hashes.count if hashes else 0
        t0 = time.perf_counter()
        reply = step_fn(step)
        out.step_ms.append((time.perf_counter() - t0) * 1e3)
        if hashes:
            out.hashes.append(hashes.count - hashed_before)
        if request_bytes:
            out.request_bytes.append(request_bytes(step))
        admitted = sum(1 for s in reply.scheduled if s.admitted)
        out.trace.append((len(reply.scheduled), admitted, len(reply.preempted), reply.num_free_blocks))
        _compute(scheduler, reply, rng)
    if daemon_cpu_s is not None:
        out.daemon_cpu_s += daemon_cpu_s()
    return out


def _compute(scheduler: Scheduler, reply: StepOutput, rng: random.Random) -> None:
    """The model's part: every chunk computed, a token sampled where wanted."""
    chunks, seqs = scheduler.apply(reply)
    for chunk, seq in zip(chunks, seqs, strict=True):
        scheduler.computed(seq, chunk)
        if not chunk.wants_logits:
            continue
        seq.output_ids.append(rng.randrange(wl.VOCAB))
        if len(seq.output_ids) >= seq.params.max_new_tokens:
            seq.finish, seq.status = Finish.LENGTH, Status.FINISHED
        scheduler.sampled(seq)
