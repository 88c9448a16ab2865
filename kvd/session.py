"""Engine sessions: who holds which requests, what waits, and for how long.

A session owns its requests from arrival to release. A request waits
(hashed once, on arrival) until the scheduler admits it, runs while it holds
blocks, may go back to waiting when preempted, and is released when the
engine reports it finished. ``Session.apply_step_reports`` takes a Step's
reports (new requests, commits, finished requests) after checking all of
them: a bad Step changes nothing.

The fence. A Step that says ``forward_in_flight`` was sent while the engine's
last forward may still be writing into the blocks of the requests it
computes. A request given up in that Step (preempted, finished, cancelled)
must not see those blocks go to another session (another engine, whose
forwards run concurrently) before that forward is done: its blocks without a
hash (the only ones a forward writes) stay held by the session's fence. The
session's own requests may take them in the same Step: the engine launches
its next forward only after it read the one in flight. The engine sends its
next Step after that too, so the session's next Step lifts the fence
(whatever that Step's own flag). A session that ends lifts it: at once on
Detach (an engine detaches after its last forward's writes landed); a lapsed
one keeps it, with its requests' blocks, in quarantine (``kvd.quarantine``)
until its engine can no longer write.

    Step k (forward k-1 in flight)          Step k+1
      preempt r: r's blocks without a hash    what is left of the fence goes
      are fenced (hashed ones are released);  back to the pool, then this
      this session may reuse them at once     Step's own give-ups are fenced

On a GPU the fence's host-side rule has a device-side twin. A tier copy into
a block starts at Step time on the daemon's copy stream, which knows nothing
of the engine's stream: a swap-in into a fenced block (the session's own
admission takes those first), or into a hashed block just given up that the
forward in flight still reads, would race that forward. So a Step that gives
up blocks while a forward is in flight leaves the session *unsettled* until
its next Step: every copy into the cache started meanwhile, by any session's
Step, first waits for that forward's event (``forward_event``, an
interprocess CUDA event the engine records after each forward).
"""

from __future__ import annotations

import bisect
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from typing import NamedTuple

from kvd.block import Block
from kvd.cache_manager import KVCacheManager
from kvd.cache_request import Request
from kvd.cache_request import schedule_order as _order
from kvd.common.cache_marks import check_marks
from kvd.common.defaults import MAX_NUM_SEQS, TOKEN_BUDGET
from kvd.common.field_error import FieldError
from kvd.common.hashing import pack_tokens
from kvd.common.process_identity import ProcessIdentity
from kvd.errors import NotFoundError
from kvd.marks import Marker, PendingMarks, ended
from kvd_api.daemon.v1 import daemon_pb2 as pb

#: Freed request ids remembered per session, to tell a double free (a caller
#: bug) from an id that was never known.
_FREED_MEMORY = 4096


#: One request's entry of a Step's commits: (request, num_computed_tokens,
#: new_token_ids). NOTE: a tuple, not a class: a decode Step makes one per
#: running request, and a class's __init__ call costs more than the commit.
Commit = tuple[Request, int, list[int]]


class AppliedReports(NamedTuple):
    """What applying a Step's reports changed that the Step's reply tells."""

    arrivals: list[Request]  # the new requests, waiting, in the Step's order
    released_ids: list[str]  # the requests the Step finished, their blocks freed


@dataclass(slots=True)
class _Checked:
    """A validated Step's reports, ids resolved to requests."""

    arrivals: list[Request]
    commits: list[Commit]
    finished: list[Request]


@dataclass(eq=False)
class Session:
    """One attached engine and its requests.

    Attributes:
        requests: every request the session holds, running or waiting.
        running: the requests holding blocks, in admission order.
        waiting: the requests waiting for admission, in schedule order
            (priority, then arrival).
        steps: how many Steps the session has sent.
        starved: its last Step left a waiting request out for want of blocks.
        forward_in_flight: the current Step was sent while a forward ran.
        fenced: blocks the session gave up while a forward of its engine ran,
            each holding one reference until its own requests take them or
            the session's next Step (see the module's docstring).
        process: the engine's process as it named itself at attach (None:
            unnamed), checked when the session's lease lapses (kvd.quarantine).
        forward_event: the IPC handle of the event its engine recorded after
            its latest forward, as the current Step brought it (b"": none, or
            no GPU).
        gave_up_in_flight: the current Step freed or fenced blocks while a
            forward was in flight (see ``unsettled_forward``).
        marked: the requests whose cache marks are not all pinned or refused
            yet (kvd.marks): the only ones a Step looks at for marks.
        mark_results: what became of marks in the current Step, for its reply.
    """

    session_id: str
    client_name: str
    last_seen: float
    requests: dict[str, Request] = field(default_factory=dict)
    running: dict[str, Request] = field(default_factory=dict)
    waiting: list[Request] = field(default_factory=list)
    recently_freed: OrderedDict[str, None] = field(default_factory=OrderedDict)
    # Limits of the session until its engine sends its own (SessionSettings): the engine's defaults.
    max_num_seqs: int = MAX_NUM_SEQS
    token_budget: int = TOKEN_BUDGET
    steps: int = 0
    arrivals: int = 0
    starved: bool = False
    forward_in_flight: bool = False
    fenced: list[Block] = field(default_factory=list)
    process: ProcessIdentity | None = None
    forward_event: bytes = b""
    gave_up_in_flight: bool = False
    marked: dict[str, Request] = field(default_factory=dict)
    mark_results: list[pb.MarkResult] = field(default_factory=list)

    def get(self, request_id: str) -> Request:
        """The request ``request_id``, running or waiting.

        Raises:
            ValueError: it was released already (a double free).
            NotFoundError: the session never had it.
        """
        request = self.requests.get(request_id)
        if request is not None:
            return request
        if request_id in self.recently_freed:
            raise ValueError(f"request {request_id!r} was already released")
        raise NotFoundError(f"unknown request {request_id!r} in session {self.session_id}")

    @property
    def unsettled_forward(self) -> bytes:
        """The event of the forward that may still read or write blocks this
        session's current Step gave up (b"": none). Copies into the cache wait
        for it until the session's next Step."""
        return self.forward_event if self.gave_up_in_flight else b""

    @property
    def num_blocks_held(self) -> int:
        return sum(len(r.blocks) for r in self.running.values()) + len(self.fenced)

    # ------------------------------------------------------- transitions

    def enqueue(self, request: Request) -> None:
        """A new request waits for admission."""
        self.arrivals += 1
        request.queued(self.arrivals)
        self.recently_freed.pop(request.request_id, None)
        self.requests[request.request_id] = request
        if request.marks is not None:
            self.marked[request.request_id] = request
        self._wait(request)

    def started(self, request: Request) -> None:
        """The scheduler admitted ``request``: it leaves the queue."""
        del self.waiting[self._waiting_index(request)]
        self.running[request.request_id] = request

    def preempt(self, manager: KVCacheManager, request: Request) -> None:
        """Frees a running request's blocks; it waits again, in its old place."""
        self._free(manager, request)
        del self.running[request.request_id]
        self._wait(request)

    def release(self, manager: KVCacheManager, request: Request) -> None:
        """Frees a request's blocks (if it holds any) and forgets it; its
        marks still pending are refused (``mark_results``)."""
        if request.marks is not None:
            self.mark_results.extend(ended(request))
            del self.marked[request.request_id]
            request.marks = None
        if self.running.pop(request.request_id, None) is not None:
            self._free(manager, request)
        else:
            del self.waiting[self._waiting_index(request)]
        del self.requests[request.request_id]
        self.recently_freed[request.request_id] = None
        if len(self.recently_freed) > _FREED_MEMORY:
            self.recently_freed.popitem(last=False)

    def release_all(self, manager: KVCacheManager) -> int:
        """Releases every request and the fence (the session ends); returns
        how many requests it held."""
        count = len(self.requests)
        self.forward_in_flight = False  # an ended session's engine writes nothing more
        for request in list(self.requests.values()):
            self.release(manager, request)
        self.lift_fence(manager)
        self.gave_up_in_flight = False
        self.mark_results.clear()  # no reply reaches an ended session's engine
        return count

    def lift_fence(self, manager: KVCacheManager) -> None:
        """Releases the blocks fenced by the last Step: its forward is done."""
        if self.fenced:
            fenced, self.fenced = self.fenced, []
            manager.pool.release(fenced)

    def _free(self, manager: KVCacheManager, request: Request) -> None:
        if self.forward_in_flight:
            self.gave_up_in_flight = True
        manager.free(request, self.fenced if self.forward_in_flight else None)

    def _wait(self, request: Request) -> None:
        bisect.insort(self.waiting, request, key=_order)

    def _waiting_index(self, request: Request) -> int:
        index = bisect.bisect_left(self.waiting, request.order, key=_order)
        assert self.waiting[index] is request, f"{request.request_id} is not waiting"
        return index

    # --------------------------------------------------------- the Step

    def apply_step_reports(
        self, manager: KVCacheManager, msg: pb.StepRequest, marker: Marker | None = None
    ) -> AppliedReports:
        """Takes a Step's reports, in order: settings, new requests, commits,
        finished requests. With a ``marker``, the marks the commits reached
        are pinned before the finished requests go (a Step may commit a
        prefill and finish its request).

        Raises:
            ValueError, NotFoundError: before any change.
        """
        checked = self._check(manager, msg)
        # NOTE: sent after the engine read the forward that was in flight at
        # the last Step, so what that Step fenced is free to go.
        self.lift_fence(manager)
        self.forward_in_flight = msg.forward_in_flight
        self.forward_event = msg.forward_event
        self.gave_up_in_flight = False
        if msg.HasField("settings"):
            self.max_num_seqs = msg.settings.max_num_seqs
            self.token_budget = msg.settings.token_budget
        for request in checked.arrivals:
            self.enqueue(request)
        running, apply_commit = self.running, manager.apply_commit
        for request, num_computed, new_token_ids in checked.commits:
            if request.request_id in running:
                apply_commit(request, num_computed, new_token_ids)
            else:  # preempted while its forward ran: its tokens still count
                request.token_ids.fromlist(new_token_ids)
        if self.marked and marker is not None:
            marker.settle(self)
        for request in checked.finished:
            self.release(manager, request)
        return AppliedReports(checked.arrivals, [r.request_id for r in checked.finished])

    def _check(self, manager: KVCacheManager, msg: pb.StepRequest) -> _Checked:
        if msg.HasField("settings"):
            _check_settings(msg.settings)
        arrivals = [_new_request(manager, new, index, self) for index, new in enumerate(msg.new_requests)]
        _unique("new_requests", [r.request_id for r in arrivals])
        commits = self._check_commits(manager, msg.commits)
        _unique("finished", msg.finished)
        arriving = {r.request_id: r for r in arrivals}
        finished = [arriving.get(rid) or self.get(rid) for rid in msg.finished]
        return _Checked(arrivals, commits, finished)

    def _check_commits(self, manager: KVCacheManager, c: pb.Commits) -> list[Commit]:
        ids, computed, counts, tokens = (
            c.request_ids[:],
            c.num_computed_tokens[:],
            c.num_new_tokens[:],
            c.new_token_ids[:],
        )
        if not len(ids) == len(computed) == len(counts):
            raise ValueError("commits: request_ids, num_computed_tokens and num_new_tokens must have the same length")
        if min(counts, default=0) < 0 or sum(counts) != len(tokens):
            raise ValueError("commits: num_new_tokens must be >= 0 and add up to len(new_token_ids)")
        _unique("commits", ids)
        try:
            pack_tokens(tokens)  # one pass checks every sampled token of the step
        except ValueError as exc:
            raise ValueError(f"commits.new_token_ids: {exc}") from None
        offsets = list(accumulate(counts, initial=0))
        commits = []
        # NOTE: a decode Step commits every running request: names bound once.
        requests, running, check = self.requests, self.running, manager.check_commit
        for request_id, num_computed, start, end in zip(ids, computed, offsets, offsets[1:], strict=False):
            request = requests.get(request_id) or self.get(request_id)
            # NOTE: check_commit's conditions, inline (a call fewer per running
            # request, each Step); it is called to say what is wrong.
            if request_id in running and not (
                request.num_computed_tokens <= num_computed <= request.num_scheduled_tokens
                and num_computed <= len(request.token_ids) + end - start
            ):
                check(request, num_computed, end - start)
            commits.append((request, num_computed, tokens[start:end]))
        return commits


def _check_settings(settings: pb.SessionSettings) -> None:
    if settings.max_num_seqs < 1:
        raise ValueError(f"settings.max_num_seqs must be >= 1, got {settings.max_num_seqs}")
    if settings.token_budget < 1:
        raise ValueError(f"settings.token_budget must be >= 1, got {settings.token_budget}")


def _new_request(manager: KVCacheManager, new: pb.NewRequest, index: int, session: Session) -> Request:
    """Checks and hashes one arrival (the only time its prompt is hashed)."""
    where = f"new_requests[{index}]"
    if not new.request_id:
        raise ValueError(f"{where}.request_id must not be empty")
    if new.request_id in session.requests:
        raise ValueError(f"{where}: request {new.request_id!r} already exists in this session")
    if not new.prompt_token_ids:
        raise ValueError(f"{where}.prompt_token_ids is empty (request {new.request_id!r})")
    if new.max_new_tokens < 0:
        raise ValueError(f"{where}.max_new_tokens must be >= 0, got {new.max_new_tokens}")
    try:
        # NOTE: one copy and one pass over the prompt: hashing its full blocks
        # validates their ids, and the manager checks the rest.
        request = manager.new_request(new.request_id, new.prompt_token_ids, new.cache_salt, new.extra_keys[:])
    except ValueError as exc:
        raise ValueError(f"{where}.prompt_token_ids: {exc}") from None
    if new.HasField("cache_marks") and new.cache_marks.marks:
        try:
            check_marks(new.cache_marks, len(request.token_ids))
        except FieldError as exc:
            raise exc.within(f"{where}.cache_marks") from None
        request.marks = PendingMarks.of(new.cache_marks)
    request.priority = new.priority
    request.max_end = len(request.token_ids) + max(new.max_new_tokens - 1, 0)
    if new.HasField("max_cached_tokens"):
        if new.max_cached_tokens < 0:
            raise ValueError(f"{where}.max_cached_tokens must be >= 0, got {new.max_cached_tokens}")
        request.max_cached_blocks = new.max_cached_tokens // manager.block_size
    return request


def _unique(what: str, request_ids: Sequence[str]) -> None:
    if len(set(request_ids)) != len(request_ids):
        seen: set[str] = set()
        dup = next(r for r in request_ids if r in seen or seen.add(r))
        raise ValueError(f"request {dup!r} appears twice in {what}")


class SessionRegistry:
    """Attached sessions and their heartbeats.

    Args:
        lease_s: a session not heard from for this long is released.
        clock: monotonic seconds the leases are read on (tests pass one they advance).
    """

    def __init__(self, lease_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if lease_s <= 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s}")
        self.lease_s = lease_s
        self.clock = clock
        self.sessions: dict[str, Session] = {}

    def open(self, client_name: str, process: ProcessIdentity | None = None) -> Session:
        session = Session(
            session_id=secrets.token_hex(8),
            client_name=client_name,
            last_seen=self.clock(),
            process=process,
        )
        self.sessions[session.session_id] = session
        return session

    def get(self, session_id: str) -> Session:
        """The live session ``session_id``; renews its lease."""
        session = self.sessions.get(session_id)
        if session is None:
            raise NotFoundError(f"unknown session {session_id!r} (expired or never attached)")
        session.last_seen = self.clock()
        return session

    def close(self, session_id: str, manager: KVCacheManager) -> int:
        """Ends a session; returns how many requests it still held."""
        return self.remove(session_id).release_all(manager)

    def remove(self, session_id: str) -> Session:
        """Takes a session out of the registry as it is (its requests keep their blocks)."""
        session = self.sessions.pop(session_id, None)
        if session is None:
            raise NotFoundError(f"unknown session {session_id!r}")
        return session

    def expired(self) -> list[str]:
        """The sessions not heard from for more than ``lease_s``."""
        now = self.clock()
        return [sid for sid, s in self.sessions.items() if now - s.last_seen > self.lease_s]

    def fair_share(self, session: Session, num_blocks: int) -> int | None:
        """The blocks ``session`` may hold before it stops admitting, or None
        (no cap): capped at an equal share while another session's waiting
        requests did not fit the pool, so no session starves another."""
        others_starved = any(s.starved for s in self.sessions.values() if s is not session)
        if not others_starved:
            return None
        busy = sum(1 for s in self.sessions.values() if s.requests)
        return num_blocks // max(busy, 1)

    def unsettled_forwards(self) -> list[bytes]:
        """The events every copy into the cache must wait for now (see
        ``Session.unsettled_forward``)."""
        return [s.unsettled_forward for s in self.sessions.values() if s.unsettled_forward]

    @property
    def num_requests(self) -> int:
        return sum(len(s.requests) for s in self.sessions.values())
