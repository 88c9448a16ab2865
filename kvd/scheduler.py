"""What a session computes next: the daemon's scheduling policy, as plain code.

One call per Step, on the session's state after its reports were applied
(``Session.apply_step_reports``). Requests are served in schedule order
(priority, then arrival), under the session's token budget:

    budget ──► decodes (running requests wanting one token; never stalled
           │   by long prefills)
           ├─► prefill chunks of running requests
           └─► admissions from the waiting queue while fewer than
               max_num_seqs run (prefix-aware: cached tokens are free;
               one whose next prompt block another request is computing
               waits for it and lets a few behind it go)

A running request wants every known token it has no slot for, and, while
the engine's forward is in flight (commits lag one step), one speculative
slot for the token that forward samples for it. When the pool cannot serve
a running request, the last request in schedule order (lowest priority,
newest) is preempted (its blocks freed; it waits again and is recomputed
later) until the request fits or was itself preempted. A step that had to
preempt admits nobody: there is no room. With a forward in flight, a
victim's blocks that forward may be writing are fenced, not freed (see
``kvd.session``): they make room for this session's requests at once (its
next forward runs after the one in flight) and for others' from its next
Step on.
"""

from __future__ import annotations

from kvd.block import Block
from kvd.cache_manager import DEFERRED, KVCacheManager
from kvd.cache_request import Request
from kvd.cache_request import schedule_order as _order
from kvd.marks import Marker
from kvd.session import Session
from kvd_api.daemon.v1 import daemon_pb2 as pb

#: Waiting requests (deferred behind another's blocks) the admission loop may
#: look past in one step; bounds the work a long queue adds to a Step.
ADMISSION_LOOKAHEAD = 8


#: One scheduled chunk: (request, first_position, num_tokens, new_blocks,
#: num_cached_tokens, num_host_cached_tokens, num_disk_cached_tokens). NOTE: a tuple, not a class: a
#: decode Step makes one per running request, and the reply transposes them
#: in one call (``zip(*rows)``).
_Row = tuple[Request, int, int, list[Block], int, int, int]
_REQUEST, _NUM_TOKENS = 0, 2


def run_step(
    manager: KVCacheManager,
    session: Session,
    msg: pb.StepRequest,
    block_cap: int | None = None,
    marker: Marker | None = None,
) -> pb.StepResponse:
    """Applies a Step's reports and schedules the next work; returns the reply
    (without ``copy_events``, which the daemon adds). ``marker``: pins the
    requests' cache marks (kvd.marks; None: they stay pending until their
    request ends).

    Raises ``ValueError`` / ``NotFoundError`` before any change on bad input.
    """
    arrivals, released = session.apply_step_reports(manager, msg, marker)
    # What the cache holds of each new prompt, before anything is admitted
    # (the engine's load reports): its hashes are at hand only here.
    arrival_cached = [manager.cached_tokens(request.reusable_hashes) for request in arrivals]
    reply = schedule(manager, session, msg.forward_in_flight, block_cap)
    reply.released.extend(released)
    reply.arrival_cached_tokens.extend(arrival_cached)
    # NOTE: after admission too, so a prefix found cached is pinned in the
    # Step that admits its request; both checks cost nothing without marks.
    if session.marked and marker is not None:
        marker.settle(session)
    if session.mark_results:
        reply.marks.extend(session.mark_results)
        if marker is not None:
            marker.count(session.mark_results)
        session.mark_results.clear()
    return reply


def schedule(
    manager: KVCacheManager, session: Session, forward_in_flight: bool, block_cap: int | None = None
) -> pb.StepResponse:
    """This step's work for ``session``.

    Args:
        forward_in_flight: the engine runs a forward whose commits are not in
            yet: requests it samples get one speculative slot.
        block_cap: admit nothing while the session holds this many blocks
            (its fair share while another session starves); None: no cap.
    """
    session.steps += 1
    rows: list[_Row] = []
    preempted: list[str] = []
    budget = _schedule_running(manager, session, forward_in_flight, rows, preempted)
    session.starved = False
    if not preempted and budget > 0 and (block_cap is None or session.num_blocks_held < block_cap):
        _admit(manager, session, budget, rows)
    for row in rows:
        row[_REQUEST].last_step = session.steps
    reply = _reply(rows)
    reply.preempted.extend(preempted)
    reply.num_waiting = len(session.waiting)
    reply.num_free_blocks = manager.pool.num_free
    return reply


def _schedule_running(
    manager: KVCacheManager, session: Session, forward_in_flight: bool, rows: list[_Row], preempted: list[str]
) -> int:
    """Serves running requests, decodes first; returns the budget left."""
    budget = session.token_budget
    decodes: list[tuple[Request, int]] = []
    prefills: list[tuple[Request, int]] = []
    last_step, running, fence = session.steps - 1, session.running, session.fenced
    for request in sorted(running.values(), key=_order):
        # What it wants: every known token without a slot, and, when its last
        # chunk ended at its last known token in the forward now in flight,
        # the slot of the token that forward samples for it. (Inline: this
        # runs for every running request, each Step.)
        end = known = len(request.token_ids)
        scheduled = request.num_scheduled_tokens
        if forward_in_flight and scheduled == known and request.last_step == last_step:
            end = known + 1
        wanted = (end if end < request.max_end else request.max_end) - scheduled
        if wanted > 0:
            (decodes if wanted == 1 else prefills).append((request, wanted))
    append = manager.append
    for request, wanted in decodes + prefills:
        if budget <= 0:
            break
        if request.request_id not in running:  # preempted by an earlier one
            continue
        num_tokens = wanted if wanted < budget else budget
        first = request.num_scheduled_tokens
        new_blocks = append(request, num_tokens, fence)
        if new_blocks is None:
            new_blocks = _preempt_until_fits(manager, session, request, num_tokens, preempted)
            if new_blocks is None:
                continue
        budget -= num_tokens
        rows.append((request, first, num_tokens, new_blocks, 0, 0, 0))
    if preempted:  # a request preempted after being scheduled gives its tokens back
        gone = set(preempted)
        budget += sum(r[_NUM_TOKENS] for r in rows if r[_REQUEST].request_id in gone)
        rows[:] = [r for r in rows if r[_REQUEST].request_id not in gone]
    return budget


def _preempt_until_fits(
    manager: KVCacheManager, session: Session, request: Request, num_tokens: int, preempted: list[str]
) -> list[Block] | None:
    """Preempts the last running request in schedule order until ``request``
    gets its slots (returns its new blocks), or was itself preempted (None)."""
    while True:
        victim = max(session.running.values(), key=_order)
        session.preempt(manager, victim)
        preempted.append(victim.request_id)
        if victim is request:
            return None
        new_blocks = manager.append(request, num_tokens, session.fenced)
        if new_blocks is not None:
            return new_blocks


def _admit(manager: KVCacheManager, session: Session, budget: int, rows: list[_Row]) -> None:
    room = session.max_num_seqs - len(session.running)
    deferred = 0
    for request in list(session.waiting):
        if room <= 0 or budget <= 0:
            return
        admitted = manager.admit(request, budget, session.fenced)
        if admitted is DEFERRED:  # waits for another request's blocks; the next in line may go
            deferred += 1
            if deferred >= ADMISSION_LOOKAHEAD:
                return
            continue
        if admitted is None:  # budget > 0, so the pool is short
            session.starved = True
            return
        session.started(request)
        room -= 1
        budget -= admitted.num_scheduled_tokens
        rows.append(
            (
                request,
                admitted.first_position,
                admitted.num_scheduled_tokens,
                admitted.blocks,
                admitted.num_cached_tokens,
                admitted.num_host_cached_tokens,
                admitted.num_disk_cached_tokens,
            )
        )


def _reply(rows: list[_Row]) -> pb.StepResponse:
    # NOTE: whole columns are extended at once; per-element appends to a
    # repeated field cost several times more at 64+ rows.
    reply = pb.StepResponse()
    if not rows:
        return reply
    requests, firsts, num_tokens, new_blocks, cached, host_cached, disk_cached = zip(*rows, strict=True)
    s = reply.scheduled
    s.request_ids.extend([r.request_id for r in requests])
    s.first_positions.extend(firsts)
    s.num_tokens.extend(num_tokens)
    s.num_cached_tokens.extend(cached)
    s.num_new_blocks.extend(map(len, new_blocks))
    s.new_block_ids.extend([b.block_id for blocks in new_blocks for b in blocks])
    if any(host_cached):
        s.num_host_cached_tokens.extend(host_cached)
    if any(disk_cached):
        s.num_disk_cached_tokens.extend(disk_cached)
    return reply
