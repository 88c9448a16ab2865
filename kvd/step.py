"""One engine step's block work, applied as a unit.

The engine sends, once per step: the commits of the tokens its last forward
computed, the requests that finished, the running requests that want slots,
and the waiting requests in priority order. The step is validated as a whole
first (bad input changes nothing), then applied in that order under one token
budget:

    budget ──► appends (running requests, in the engine's order)
           └─► admissions (waiting requests, in priority order, until the
               first that does not fit: later ones must not jump the queue)

When the pool cannot serve a running request, the newest request of the
session is preempted (freed; the engine re-admits it later and recomputes)
until the append fits or the request itself was the newest. A step that had
to preempt admits nobody: there is no room.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvd.cache_manager import KVCacheManager
from kvd.hashing import token_bytes
from kvd.request import Request
from kvd.session import Session


@dataclass(frozen=True, slots=True)
class CommitWork:
    request_id: str
    num_computed_tokens: int
    new_token_ids: Sequence[int] = ()


@dataclass(frozen=True, slots=True)
class AppendWork:
    request_id: str
    num_tokens: int


@dataclass(frozen=True, slots=True)
class AdmissionWork:
    request_id: str
    token_ids: Sequence[int]
    cache_salt: bytes = b""
    extra_keys: Sequence[bytes] = ()


@dataclass(frozen=True, slots=True)
class StepInput:
    commits: Sequence[CommitWork] = ()
    frees: Sequence[str] = ()
    appends: Sequence[AppendWork] = ()
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


@dataclass(slots=True)
class StepOutput:
    scheduled: list[Scheduled] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    waiting: list[str] = field(default_factory=list)
    num_free_blocks: int = 0


def run_step(manager: KVCacheManager, session: Session, step: StepInput) -> StepOutput:
    """Validates and applies one step. Raises before any change on bad input."""
    new_requests = _validate(manager, session, step)
    for commit in step.commits:
        manager.commit(session.requests[commit.request_id], commit.num_computed_tokens, commit.new_token_ids)
    for request_id in step.frees:
        session.release(manager, session.requests[request_id])
    out = StepOutput()
    budget = _schedule_running(manager, session, step, out)
    _schedule_waiting(manager, session, new_requests, budget, out)
    out.num_free_blocks = manager.pool.num_free
    return out


def _schedule_running(manager: KVCacheManager, session: Session, step: StepInput, out: StepOutput) -> int:
    """Serves appends in order; returns the budget left."""
    budget = step.token_budget
    for append in step.appends:
        if budget <= 0:
            break
        request = session.requests.get(append.request_id)
        if request is None:  # preempted earlier in this step
            continue
        num_tokens = min(append.num_tokens, budget)
        first = request.num_scheduled_tokens
        new_blocks = _append_or_preempt(manager, session, request, num_tokens, out)
        if new_blocks is None:
            continue
        budget -= num_tokens
        out.scheduled.append(
            Scheduled(append.request_id, False, first, num_tokens, 0, [b.block_id for b in new_blocks])
        )
    # A request preempted after being scheduled gives its tokens back.
    if out.preempted:
        gone = set(out.preempted)
        budget += sum(s.num_scheduled_tokens for s in out.scheduled if s.request_id in gone)
        out.scheduled = [s for s in out.scheduled if s.request_id not in gone]
    return budget


def _append_or_preempt(manager, session, request: Request, num_tokens: int, out: StepOutput):
    while True:
        new_blocks = manager.append(request, num_tokens)
        if new_blocks is not None:
            return new_blocks
        victim = session.newest()
        session.release(manager, victim)
        out.preempted.append(victim.request_id)
        if victim is request:
            return None


def _schedule_waiting(
    manager: KVCacheManager, session: Session, requests: list[Request], budget: int, out: StepOutput
) -> None:
    for index, request in enumerate(requests):
        admitted = None if (budget <= 0 or out.preempted) else manager.admit(request, budget)
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
            )
        )


def _validate(manager: KVCacheManager, session: Session, step: StepInput) -> list[Request]:
    """Checks the whole step against the session; returns the new requests."""
    if (step.appends or step.admissions) and step.token_budget < 1:
        raise ValueError(f"token_budget must be >= 1, got {step.token_budget}")
    _unique("commits", [c.request_id for c in step.commits])
    for commit in step.commits:
        request = session.get(commit.request_id)
        manager.check_commit(request, commit.num_computed_tokens, len(commit.new_token_ids))
        if commit.new_token_ids:
            token_bytes(commit.new_token_ids)
    _unique("frees (double free)", step.frees)
    for request_id in step.frees:
        session.get(request_id)
    freed = set(step.frees)
    _unique("appends", [a.request_id for a in step.appends])
    for append in step.appends:
        session.get(append.request_id)
        if append.request_id in freed:
            raise ValueError(f"request {append.request_id!r} is both freed and appended")
        if append.num_tokens < 1:
            raise ValueError(f"request {append.request_id!r}: num_tokens must be >= 1, got {append.num_tokens}")
    _unique("admissions", [a.request_id for a in step.admissions])
    new_requests = []
    for adm in step.admissions:
        if not adm.request_id:
            raise ValueError("request_id must not be empty")
        if adm.request_id in session.requests and adm.request_id not in freed:
            raise ValueError(f"request {adm.request_id!r} is already running")
        new_requests.append(manager.new_request(adm.request_id, adm.token_ids, adm.cache_salt, adm.extra_keys))
    return new_requests


def _unique(what: str, request_ids: Sequence[str]) -> None:
    if len(set(request_ids)) != len(request_ids):
        seen: set[str] = set()
        dup = next(r for r in request_ids if r in seen or seen.add(r))
        raise ValueError(f"request {dup!r} appears twice in {what}")
