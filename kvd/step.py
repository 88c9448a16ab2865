"""One engine step's block work, applied as a unit.

The engine sends, once per step: the commits of the tokens its last forward
computed, the requests that finished, the running requests that want slots,
and the waiting requests in priority order. The step is validated as a whole
first (bad input changes nothing), then applied in that order under one token
budget:

    budget ──► appends (running requests, in the engine's order)
           └─► admissions (waiting requests, in priority order, until the
               first that does not fit: later ones must not jump the queue;
               one whose next prompt block another request is computing
               waits for it, and lets the next one go)

When the pool cannot serve a running request, the newest request of the
session is preempted (freed; the engine re-admits it later and recomputes)
until the append fits or the request itself was the newest. A step that had
to preempt admits nobody: there is no room.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from kvd.block import Block
from kvd.cache_manager import DEFERRED, KVCacheManager
from kvd.hashing import token_bytes
from kvd.request import Request
from kvd.session import Session


# NOTE: the step only unpacks these, so any (request_id, num_computed_tokens,
# new_token_ids) tuple serves as a CommitWork, and (request_id, num_tokens) as
# an AppendWork: the wire layer builds plain tuples with zip(), several times
# cheaper than named tuples, and a decode step has one per running request.
class CommitWork(NamedTuple):
    request_id: str
    num_computed_tokens: int
    new_token_ids: Sequence[int] = ()


class AppendWork(NamedTuple):
    request_id: str
    num_tokens: int


class AdmissionWork(NamedTuple):
    request_id: str
    token_ids: Sequence[int]
    cache_salt: bytes = b""
    extra_keys: Sequence[bytes] = ()


@dataclass(frozen=True, slots=True)
class StepInput:
    commits: Sequence[tuple[str, int, Sequence[int]]] = ()  # CommitWork or its plain tuple
    frees: Sequence[str] = ()
    appends: Sequence[tuple[str, int]] = ()  # AppendWork or its plain tuple
    admissions: Sequence[AdmissionWork] = ()
    token_budget: int = 0


@dataclass(slots=True)
class Scheduled:
    """Compute tokens ``[first_position, first_position + num_scheduled_tokens)``."""

    request_id: str
    admitted: bool
    first_position: int
    num_scheduled_tokens: int
    num_cached_tokens: int
    new_block_ids: list[int]
    num_host_cached_tokens: int = 0  # of num_cached_tokens, copied back from the host tier


@dataclass(slots=True)
class StepOutput:
    scheduled: list[Scheduled] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    waiting: list[str] = field(default_factory=list)
    num_free_blocks: int = 0
    # On CUDA: interprocess events of copies into the cache that the engine's
    # stream must wait for before its forward reads the cache.
    copy_events: list[bytes] = field(default_factory=list)


@dataclass(slots=True)
class _Resolved:
    """A validated step, with its request ids resolved to requests."""

    commits: list[tuple[Request, int, Sequence[int]]]
    frees: list[Request]
    appends: list[tuple[Request, int]]
    admissions: list[Request]


def run_step(manager: KVCacheManager, session: Session, step: StepInput) -> StepOutput:
    """Validates and applies one step. Raises before any change on bad input."""
    work = _validate(manager, session, step)
    for request, num_computed, new_token_ids in work.commits:
        manager.apply_commit(request, num_computed, new_token_ids)
    for request in work.frees:
        session.release(manager, request)
    out = StepOutput()
    budget = _schedule_running(manager, session, work.appends, step.token_budget, out)
    _schedule_waiting(manager, session, work.admissions, budget, out)
    out.num_free_blocks = manager.pool.num_free
    return out


def _schedule_running(
    manager: KVCacheManager, session: Session, appends: list[tuple[Request, int]], budget: int, out: StepOutput
) -> int:
    """Serves appends in order; returns the budget left."""
    scheduled = out.scheduled
    for request, wanted in appends:
        if budget <= 0:
            break
        if out.preempted and request.request_id in out.preempted:
            continue
        num_tokens = min(wanted, budget)
        first = request.num_scheduled_tokens
        new_blocks = manager.append(request, num_tokens)
        if new_blocks is None:
            new_blocks = _preempt_until_fits(manager, session, request, num_tokens, out)
            if new_blocks is None:
                continue
        budget -= num_tokens
        block_ids = [b.block_id for b in new_blocks] if new_blocks else []
        scheduled.append(Scheduled(request.request_id, False, first, num_tokens, 0, block_ids))
    # A request preempted after being scheduled gives its tokens back.
    if out.preempted:
        gone = set(out.preempted)
        budget += sum(s.num_scheduled_tokens for s in scheduled if s.request_id in gone)
        out.scheduled = [s for s in scheduled if s.request_id not in gone]
    return budget


def _preempt_until_fits(
    manager: KVCacheManager, session: Session, request: Request, num_tokens: int, out: StepOutput
) -> list[Block] | None:
    """Frees the newest requests until ``request`` gets its slots (returns its
    new blocks), or until it was itself the newest and got preempted (None)."""
    while True:
        victim = session.newest()
        session.release(manager, victim)
        out.preempted.append(victim.request_id)
        if victim is request:
            return None
        new_blocks = manager.append(request, num_tokens)
        if new_blocks is not None:
            return new_blocks


def _schedule_waiting(
    manager: KVCacheManager, session: Session, requests: list[Request], budget: int, out: StepOutput
) -> None:
    for index, request in enumerate(requests):
        admitted = None if (budget <= 0 or out.preempted) else manager.admit(request, budget)
        if admitted is DEFERRED:  # waits for another request's blocks; the next in line may go
            out.waiting.append(request.request_id)
            continue
        if admitted is None:
            out.waiting.extend(r.request_id for r in requests[index:])
            return
        session.add(request)
        budget -= admitted.num_scheduled_tokens
        out.scheduled.append(
            Scheduled(
                request.request_id,
                True,
                admitted.first_position,
                admitted.num_scheduled_tokens,
                admitted.num_cached_tokens,
                [b.block_id for b in admitted.blocks],
                admitted.num_host_cached_tokens,
            )
        )


def _validate(manager: KVCacheManager, session: Session, step: StepInput) -> _Resolved:
    """Checks the whole step against the session, changing nothing."""
    if (step.appends or step.admissions) and step.token_budget < 1:
        raise ValueError(f"token_budget must be >= 1, got {step.token_budget}")
    _unique("commits", [c[0] for c in step.commits])
    commits = []
    for request_id, num_computed, new_token_ids in step.commits:
        request = session.get(request_id)
        manager.check_commit(request, num_computed, len(new_token_ids))
        commits.append((request, num_computed, new_token_ids))
    # One conversion checks every sampled token of the step.
    token_bytes([t for c in step.commits for t in c[2]])
    _unique("frees (double free)", step.frees)
    frees = [session.get(request_id) for request_id in step.frees]
    freed = set(step.frees)
    _unique("appends", [a[0] for a in step.appends])
    appends = []
    for request_id, num_tokens in step.appends:
        request = session.get(request_id)
        if request_id in freed:
            raise ValueError(f"request {request_id!r} is both freed and appended")
        if num_tokens < 1:
            raise ValueError(f"request {request_id!r}: num_tokens must be >= 1, got {num_tokens}")
        appends.append((request, num_tokens))
    _unique("admissions", [a.request_id for a in step.admissions])
    admissions = []
    for adm in step.admissions:
        if not adm.request_id:
            raise ValueError("request_id must not be empty")
        if adm.request_id in session.requests and adm.request_id not in freed:
            raise ValueError(f"request {adm.request_id!r} is already running")
        admissions.append(manager.new_request(adm.request_id, adm.token_ids, adm.cache_salt, adm.extra_keys))
    return _Resolved(commits, frees, appends, admissions)


def _unique(what: str, request_ids: Sequence[str]) -> None:
    if len(set(request_ids)) != len(request_ids):
        seen: set[str] = set()
        dup = next(r for r in request_ids if r in seen or seen.add(r))
        raise ValueError(f"request {dup!r} appears twice in {what}")
