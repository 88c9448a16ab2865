"""The block-pool benchmark through kvd's Step contract, version 2 (in-process or RPC).

Three ways to walk a workload or a decode through Steps, each taking a
``step_fn`` (``kvd.scheduler.run_step`` on an in-process session, or a
session's Step RPC); prompts are sent once, as new requests, and the daemon
schedules them (prompt only: ``max_new_tokens`` 0):

    drive_per_request  one Step per request: request i-1 computed, i-8
                       finished, request i new (the lifecycle of
                       ``block_pool_workloads``);
    drive_batched      8 new requests per Step, as an engine sends a burst:
                       each Step commits the previous Step's chunks and
                       finishes the requests they completed; one whose next
                       block another request is computing waits in the
                       daemon and is admitted later;
    decode_steps       64 running requests, one token each per Step.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

import block_pool_workloads as wl
import harness
from block_pool_workloads import BLOCK_SIZE, IN_FLIGHT, TOKEN_BUDGET, Run, Workload

from kvd_api.daemon.v1 import daemon_pb2 as pb

StepFn = Callable[[pb.StepRequest], pb.StepResponse]
#: The most requests running at once: never the limit here (8 are in flight).
MAX_NUM_SEQS = 4 * IN_FLIGHT


def drive_per_request(w: Workload, label: str, step_fn: StepFn) -> Run:
    """Step i reports request i-1 computed, i-8 finished, and sends request i."""
    n = len(w.prompts)
    run = Run(op_us={"step": []})
    t_step = run.op_us["step"]
    settings = pb.SessionSettings(max_num_seqs=MAX_NUM_SEQS, token_budget=TOKEN_BUDGET)
    clock = time.perf_counter_ns
    progress = harness.Progress(label, n)
    start, cpu_start = clock(), time.process_time()
    for commit, frees, admit in wl.schedule(n):
        msg = pb.StepRequest(finished=[f"r{i}" for i in frees], settings=settings if commit is None else None)
        if commit is not None:
            _commit(msg, [(f"r{commit}", len(w.prompts[commit]))])
        if admit is not None:
            msg.new_requests.add(request_id=f"r{admit}", prompt_token_ids=w.prompts[admit])
        t0 = clock()
        out = step_fn(msg)
        if admit is None:
            continue
        t_step.append((clock() - t0) / 1e3)
        s = out.scheduled
        if out.num_waiting or out.preempted or list(s.request_ids) != [f"r{admit}"]:
            raise RuntimeError(f"{w.name}: request {admit} was not admitted ({out.num_waiting} waiting)")
        if s.first_positions[0] + s.num_tokens[0] != len(w.prompts[admit]):
            raise RuntimeError(f"{w.name}: request {admit} was not scheduled whole")
        _account(run, out)
        if admit % 64 == 0:
            progress.advance(64)
    run.wall_s, run.cpu_s = (clock() - start) / 1e9, time.process_time() - cpu_start
    progress.done()
    run.prompt_tokens = sum(map(len, w.prompts))
    return run


def drive_batched(w: Workload, label: str, step_fn: StepFn) -> Run:
    """8 new requests per Step, sent once; each Step commits what the last
    one scheduled and finishes the requests whose prompts are then computed.
    The daemon keeps a request whose next block another is computing waiting
    and admits it in a later Step. ``op_us["step"]`` is per Step."""
    n = len(w.prompts)
    run = Run(op_us={"step": []}, extra={"steps": 0, "deferred_admissions": 0})
    t_step = run.op_us["step"]
    budget = IN_FLIGHT * max(map(len, w.prompts))
    settings = pb.SessionSettings(max_num_seqs=MAX_NUM_SEQS, token_budget=budget)
    lengths = {f"r{i}": len(p) for i, p in enumerate(w.prompts)}
    sent = done = 0
    computing: list[tuple[str, int]] = []  # (request, end of its chunk) scheduled by the last Step
    clock = time.perf_counter_ns
    progress = harness.Progress(label, n)
    start, cpu_start = clock(), time.process_time()
    while done < n:
        complete = [r for r, end in computing if end == lengths[r]]
        msg = pb.StepRequest(finished=complete, settings=settings if sent == 0 else None)
        _commit(msg, computing)
        for i in range(sent, min(sent + IN_FLIGHT, n)):
            msg.new_requests.add(request_id=f"r{i}", prompt_token_ids=w.prompts[i])
        sent = min(sent + IN_FLIGHT, n)
        t0 = clock()
        out = step_fn(msg)
        t_step.append((clock() - t0) / 1e3)
        if out.preempted:
            raise RuntimeError(f"{w.name}: preempted {list(out.preempted)} with {IN_FLIGHT} in flight")
        s = out.scheduled
        done += len(complete)
        computing = [(r, f + t) for r, f, t in zip(s.request_ids, s.first_positions, s.num_tokens, strict=True)]
        _account(run, out)
        run.extra["steps"] += 1
        run.extra["deferred_admissions"] += out.num_waiting
        if run.extra["steps"] > 4 * n + 16:
            raise RuntimeError(f"{w.name}: {done} of {n} requests done after {run.extra['steps']} Steps")
        progress.advance(len(complete))
    run.wall_s, run.cpu_s = (clock() - start) / 1e9, time.process_time() - cpu_start
    progress.done()
    run.prompt_tokens = sum(map(len, w.prompts))
    return run


def _commit(msg: pb.StepRequest, computed: list[tuple[str, int]], sampled: list[int] | None = None) -> None:
    """Commits as columns: (request id, tokens computed), one sampled token each when given."""
    c = msg.commits
    c.request_ids.extend([r for r, _ in computed])
    c.num_computed_tokens.extend([k for _, k in computed])
    c.num_new_tokens.extend([1 if sampled else 0] * len(computed))
    if sampled:
        c.new_token_ids.extend(sampled)


def _account(run: Run, out: pb.StepResponse) -> None:
    s = out.scheduled
    for cached, new_blocks in zip(s.num_cached_tokens, s.num_new_blocks, strict=True):
        run.cached_tokens += cached
        run.new_blocks += new_blocks - cached // BLOCK_SIZE


def decode_steps(
    step_fn: StepFn,
    running: int,
    prompt_len: int,
    steps: int,
    warmup: int,
    seed: int,
    after_step: Callable[[], Any] | None = None,
) -> list[float]:
    """Admits ``running`` prompts, then times decode steps; returns ms per timed step.

    Each decode step commits every request's last computed position and its
    newly sampled token, and the daemon schedules one token for each: what
    an engine sends per step (without pipelining). ``after_step`` runs after
    each timed step, outside its time (an empty call timed beside it).
    """
    rng = random.Random(f"block_pool/decode/{seed}")
    ids = [f"d{k}" for k in range(running)]
    first = pb.StepRequest(settings=pb.SessionSettings(max_num_seqs=running, token_budget=running * prompt_len))
    for r in ids:
        first.new_requests.add(
            request_id=r, prompt_token_ids=wl.random_tokens(rng, prompt_len), max_new_tokens=warmup + steps + 2
        )
    if len(step_fn(first).scheduled.request_ids) != running:
        raise RuntimeError("decode: not every request was admitted")
    times_ms = []
    for s in range(warmup + steps):
        msg = pb.StepRequest(
            settings=pb.SessionSettings(max_num_seqs=running, token_budget=running) if s == 0 else None
        )
        _commit(msg, [(r, prompt_len + s) for r in ids], wl.random_tokens(rng, running))
        t0 = time.perf_counter()
        out = step_fn(msg)
        elapsed = time.perf_counter() - t0
        if len(out.scheduled.request_ids) != running or out.preempted or any(n != 1 for n in out.scheduled.num_tokens):
            raise RuntimeError(
                f"decode step {s}: {len(out.scheduled.request_ids)} scheduled, preempted {list(out.preempted)}"
            )
        if s >= warmup:
            times_ms.append(elapsed * 1e3)
            if after_step is not None:
                after_step()
    return times_ms


def decode_blocks(running: int, prompt_len: int, steps: int) -> int:
    return running * -(-(prompt_len + steps + 1) // BLOCK_SIZE)
