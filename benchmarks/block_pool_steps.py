"""The block-pool benchmark through kvd's Step contract (in-process or RPC).

Three ways to walk a workload or a decode through Steps, each taking a
``step_fn`` (``run_step`` on an in-process manager, or a session's Step RPC):

    drive_per_request  one Step per request: commit request i-1, free i-8,
                       admit i (the lifecycle of ``block_pool_workloads``);
    drive_batched      admissions batched as an engine sends them: each Step
                       commits and frees the previous Step's requests and
                       offers the next 8; one whose next block another
                       request is computing waits and is offered again;
    decode_steps       64 running requests, one token each per Step.
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import _common as common
import block_pool_workloads as wl
from block_pool_workloads import BLOCK_SIZE, IN_FLIGHT, TOKEN_BUDGET, Run, Workload

from kvd.step import AdmissionWork, AppendWork, CommitWork, StepInput, StepOutput

StepFn = Callable[[StepInput], StepOutput]


def drive_per_request(w: Workload, label: str, step_fn: StepFn) -> Run:
    n = len(w.prompts)
    run = Run(op_us={"step": []})
    t_step = run.op_us["step"]
    clock = time.perf_counter_ns
    progress = common.Progress(label, n)
    start, cpu_start = clock(), time.process_time()
    for commit, frees, admit in wl.schedule(n):
        step = StepInput(
            commits=[CommitWork(f"r{commit}", len(w.prompts[commit]))] if commit is not None else [],
            frees=[f"r{i}" for i in frees],
            admissions=[AdmissionWork(f"r{admit}", w.prompts[admit])] if admit is not None else [],
            token_budget=TOKEN_BUDGET,
        )
        t0 = clock()
        out = step_fn(step)
        if admit is None:
            continue
        t_step.append((clock() - t0) / 1e3)
        if out.waiting or out.preempted or len(out.scheduled) != 1:
            raise RuntimeError(f"{w.name}: request {admit} was not admitted (waiting={list(out.waiting)})")
        _account(run, out)
        if admit % 64 == 0:
            progress.advance(64)
    run.wall_s, run.cpu_s = (clock() - start) / 1e9, time.process_time() - cpu_start
    progress.done()
    run.prompt_tokens = sum(map(len, w.prompts))
    return run


def drive_batched(w: Workload, label: str, step_fn: StepFn) -> Run:
    """Up to ``IN_FLIGHT`` admissions per Step; ``op_us["step"]`` is per Step."""
    n = len(w.prompts)
    run = Run(op_us={"step": []}, extra={"steps": 0, "deferred_admissions": 0})
    t_step = run.op_us["step"]
    budget = IN_FLIGHT * max(map(len, w.prompts))  # a batch is never short of budget
    pending = deque(range(n))
    previous: list[int] = []  # admitted by the last Step: committed and freed by the next
    clock = time.perf_counter_ns
    progress = common.Progress(label, n)
    start, cpu_start = clock(), time.process_time()
    while pending or previous:
        offered = [pending.popleft() for _ in range(min(IN_FLIGHT, len(pending)))]
        step = StepInput(
            commits=[CommitWork(f"r{i}", len(w.prompts[i])) for i in previous],
            frees=[f"r{i}" for i in previous],
            admissions=[AdmissionWork(f"r{i}", w.prompts[i]) for i in offered],
            token_budget=budget,
        )
        t0 = clock()
        out = step_fn(step)
        t_step.append((clock() - t0) / 1e3)
        if out.preempted:
            raise RuntimeError(f"{w.name}: preempted {list(out.preempted)} with {IN_FLIGHT} in flight")
        waiting = set(out.waiting)
        pending.extendleft(reversed([i for i in offered if f"r{i}" in waiting]))
        previous = [i for i in offered if f"r{i}" not in waiting]
        _account(run, out)
        run.extra["steps"] += 1
        run.extra["deferred_admissions"] += len(waiting)
        progress.advance(len(previous))
    run.wall_s, run.cpu_s = (clock() - start) / 1e9, time.process_time() - cpu_start
    progress.done()
    run.prompt_tokens = sum(map(len, w.prompts))
    return run


def _account(run: Run, out: StepOutput) -> None:
    for s in out.scheduled:
        if not s.admitted:
            raise RuntimeError(f"{s.request_id} was scheduled without being admitted")
        run.cached_tokens += s.num_cached_tokens
        run.new_blocks += len(s.new_block_ids) - s.num_cached_tokens // BLOCK_SIZE


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

    Each decode step commits every request's last sampled token
    (``num_computed_tokens`` + 1, one new token id) and appends one token for
    each: what an engine sends per step. ``after_step`` runs after each timed
    step, outside its time (an empty call timed beside it).
    """
    rng = random.Random(f"block_pool/decode/{seed}")
    ids = [f"d{k}" for k in range(running)]
    prompts = [wl.random_tokens(rng, prompt_len) for _ in ids]
    first = StepInput(
        admissions=[AdmissionWork(r, p) for r, p in zip(ids, prompts, strict=True)],
        token_budget=running * prompt_len,
    )
    if len(step_fn(first).scheduled) != running:
        raise RuntimeError("decode: not every request was admitted")
    appends = [AppendWork(r, 1) for r in ids]
    times_ms = []
    for s in range(warmup + steps):
        computed = prompt_len + s
        tokens = wl.random_tokens(rng, running)
        step = StepInput(
            commits=[CommitWork(r, computed, [t]) for r, t in zip(ids, tokens, strict=True)],
            appends=appends,
            token_budget=running,
        )
        t0 = time.perf_counter()
        out = step_fn(step)
        elapsed = time.perf_counter() - t0
        if len(out.scheduled) != running or out.preempted:
            raise RuntimeError(f"decode step {s}: {len(out.scheduled)} scheduled, preempted {list(out.preempted)}")
        if s >= warmup:
            times_ms.append(elapsed * 1e3)
            if after_step is not None:
                after_step()
    return times_ms


def decode_blocks(running: int, prompt_len: int, steps: int) -> int:
    return running * -(-(prompt_len + steps + 1) // BLOCK_SIZE)
