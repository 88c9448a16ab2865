"""The block-pool benchmark's ``waiting`` workload: a long queue at a full pool.

256 requests of 8,000 tokens arrive at once at an engine whose daemon pool
holds 16 of them. The engine's request table (``inference.requests``) builds
every Step as the engine's loop does (pipelined: the Step for step N+1 goes
out while forward N runs, and N's results are committed in the Step after),
and a stand-in for the model computes each chunk it is given and samples one
token where a chunk wants logits; requests finish after 64 tokens and free
their blocks, and the next waiting one takes their place. The token budget
holds one whole prompt, so the pool is full after about 16 Steps; the Steps
after ``warmup_steps`` are the steady state (a full pool, ~200 waiting).

All 256 reach the request table before the first Step; the engine spreads
their prompts over the first Steps (``MAX_PROMPT_TOKENS_PER_STEP`` of
``inference.requests``: 16 prompts a Step), the arrival Steps, reported on
their own (summed).

What is measured per Step: its latency, the bytes of the request on the wire
and the SHA-256 block hashes the daemon computes (counted in-process, where
the same code runs as in the daemon: the hash function is wrapped).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import block_pool_workloads as wl
import harness

from inference.requests import Finish, RequestTable, Sequence, Work
from inference.sampling import SamplingParams
from kvd.block_pool import BlockPool
from kvd.cache_manager import KVCacheManager
from kvd.common.hashing import BlockHasher
from kvd.scheduler import run_step
from kvd.session import Session
from kvd_api.daemon.v1 import daemon_pb2 as pb


@dataclass(frozen=True)
class Shape:
    """The workload's sizes (the defaults are the benchmark's; tests shrink them)."""

    requests: int = 256
    prompt_tokens: int = 8000
    pool_requests: int = 16  # the pool holds this many whole requests
    max_new_tokens: int = 64
    max_num_seqs: int = 64  # the engine's default (kvd/common/defaults.py MAX_NUM_SEQS)
    token_budget: int = 8192  # one whole prompt per Step, so the pool fills in ~16 Steps
    warmup_steps: int = 24

    @property
    def num_blocks(self) -> int:
        return self.pool_requests * -(-(self.prompt_tokens + self.max_new_tokens) // wl.BLOCK_SIZE)

    def params(self, steps: int) -> dict[str, Any]:
        return {
            **asdict(self),
            "num_blocks": self.num_blocks,
            "steady_steps": steps,
            "engine": "inference.requests.RequestTable, pipelined as inference.engine (what the engine sends)",
        }


@dataclass
class WaitingRun:
    step_ms: list[float] = field(default_factory=list)
    request_bytes: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)
    waiting: list[int] = field(default_factory=list)
    # per step: (scheduled, admitted, preempted, free blocks after it)
    trace: list[tuple[int, int, int, int]] = field(default_factory=list)
    arrival_steps: int = 0  # the first Steps, which carried the arrivals
    daemon_cpu_s: float | None = None  # the daemon process's CPU over the steady Steps (RPC only)


class HashCounter:
    """Counts SHA-256 block digests by wrapping the block hasher's one method that makes them."""

    def __init__(self) -> None:
        self.count = 0

    @contextmanager
    def installed(self) -> Iterator[HashCounter]:
        original = BlockHasher.advance

        def counting(hasher: BlockHasher, *args, **kwargs) -> list[bytes]:
            hashes = original(hasher, *args, **kwargs)
            self.count += len(hashes)
            return hashes

        BlockHasher.advance = counting  # type: ignore[method-assign]
        try:
            yield self
        finally:
            BlockHasher.advance = original  # type: ignore[method-assign]


def run_inprocess(shape: Shape, steps: int, seed: int) -> WaitingRun:
    """The daemon's Step code in this process, its block hashes counted (and
    the request bytes, without the session id an RPC adds)."""
    manager = KVCacheManager(BlockPool(shape.num_blocks), wl.BLOCK_SIZE)
    session = Session(session_id="bench", client_name="block_pool", last_seen=0.0)
    with HashCounter().installed() as counter:
        step_fn = lambda msg: run_step(manager, session, msg)  # noqa: E731
        return run(step_fn, shape, steps, seed, request_bytes=lambda msg: msg.ByteSize(), hashes=counter)


def run(
    step_fn: Callable[[pb.StepRequest], pb.StepResponse],
    shape: Shape,
    steps: int,
    seed: int,
    request_bytes: Callable[[pb.StepRequest], int] | None = None,
    hashes: HashCounter | None = None,
    daemon_cpu_s: Callable[[], float] | None = None,
) -> WaitingRun:
    """All requests arrive, then ``shape.warmup_steps + steps`` engine steps, each measured."""
    rng = random.Random(f"block_pool/waiting/{seed}")
    table = RequestTable(shape.max_num_seqs, shape.token_budget)
    sampling = SamplingParams(max_new_tokens=shape.max_new_tokens, ignore_eos=True)
    for i in range(shape.requests):
        table.add(Sequence(f"w{i}", wl.random_tokens(rng, shape.prompt_tokens), sampling))
    out = WaitingRun()
    in_flight: list[Work] = []  # the forward running while the next Step goes out
    for index in range(shape.warmup_steps + steps):
        if daemon_cpu_s is not None and index == shape.warmup_steps:
            out.daemon_cpu_s = -daemon_cpu_s()
        msg = table.build_step([w.seq.request_id for w in in_flight])
        hashed_before = hashes.count if hashes else 0
        t0 = time.perf_counter()
        reply = step_fn(msg)
        out.step_ms.append((time.perf_counter() - t0) * 1e3)
        if hashes:
            out.hashes.append(hashes.count - hashed_before)
        if request_bytes:
            out.request_bytes.append(request_bytes(msg))
        if msg.new_requests:
            assert out.arrival_steps == index, "arrivals in consecutive Steps from the first"
            out.arrival_steps += 1
        out.waiting.append(reply.num_waiting)
        admitted = sum(1 for r in reply.scheduled.request_ids if not table.seqs[r].block_table)
        work = table.apply_step_reply(reply).work
        out.trace.append((len(reply.scheduled.request_ids), admitted, len(reply.preempted), reply.num_free_blocks))
        _read_results(table, in_flight, rng)
        in_flight = [w for w in work if not w.seq.is_finished]
    if daemon_cpu_s is not None:
        out.daemon_cpu_s += daemon_cpu_s()
    return out


def _read_results(table: RequestTable, forward: list[Work], rng: random.Random) -> None:
    """The model's part, one Step late: every chunk computed, a token sampled where wanted."""
    for w in forward:
        seq = w.seq
        table.computed(seq, w.end)
        if w.end != seq.num_tokens or seq.is_finished:
            continue
        token = rng.randrange(wl.VOCAB)
        seq.output_ids.append(token)
        table.sampled(seq, token)
        if len(seq.output_ids) >= seq.params.max_new_tokens:
            seq.finish = Finish.LENGTH
            table.finished(seq)


def summarize(runs: list[WaitingRun], shape: Shape, steady_steps: int | None = None) -> dict[str, Any]:
    """Steady state (after the warm-up; its first ``steady_steps`` when given)
    and the arrival Steps apart (summed). Latency: medians over turns of each
    turn's percentile; counts: the first turn's."""
    end = None if steady_steps is None else shape.warmup_steps + steady_steps
    first, steady = runs[0], slice(shape.warmup_steps, end)
    arrival = slice(0, first.arrival_steps)
    num_steady = len(first.step_ms[steady])
    out = {
        "step_p50_ms": harness.median([harness.median(r.step_ms[steady]) for r in runs]),
        "step_p99_ms": harness.median([harness.percentile(r.step_ms[steady], 99) for r in runs]),
        "arrival_steps": first.arrival_steps,
        "arrival_step_ms": harness.median([sum(r.step_ms[arrival]) for r in runs]),
        "waiting_requests": shape.requests,
        "waiting_requests_steady_min": min(first.waiting[steady]),
        "steady_steps": num_steady,
        "repeats": len(runs),
        "admitted_steady": sum(t[1] for t in first.trace[steady]),
        "preempted_steady": sum(t[2] for t in first.trace[steady]),
        "free_blocks_steady_max": max(t[3] for t in first.trace[steady]),
    }
    if first.daemon_cpu_s is not None:
        out["daemon_cpu_ms_per_step"] = harness.median([r.daemon_cpu_s * 1e3 / num_steady for r in runs])
    if first.request_bytes:
        out["request_bytes_per_step"] = harness.mean(first.request_bytes[steady])
        out["request_bytes_per_step_max"] = max(first.request_bytes[steady])
        out["arrival_step_request_bytes"] = sum(first.request_bytes[arrival])
    if first.hashes:
        out["hashes_per_step"] = harness.mean(first.hashes[steady])
        out["hashes_per_step_max"] = max(first.hashes[steady])
        out["arrival_step_hashes"] = sum(first.hashes[arrival])
    return out
