"""Engine sessions: who holds which requests, and for how long."""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from kvd.cache_manager import KVCacheManager
from kvd.errors import NotFoundError
from kvd.request import Request

#: Freed request ids remembered per session, to tell a double free (a caller
#: bug) from an id that was never known.
_FREED_MEMORY = 4096


@dataclass(eq=False)
class Session:
    """One attached engine and the requests it holds, oldest first."""

    session_id: str
    client_name: str
    last_seen: float
    requests: dict[str, Request] = field(default_factory=dict)
    recently_freed: OrderedDict[str, None] = field(default_factory=OrderedDict)

    def get(self, request_id: str) -> Request:
        """The running request ``request_id``.

        Raises:
            ValueError: it was freed already (a double free).
            NotFoundError: the session never had it.
        """
        request = self.requests.get(request_id)
        if request is not None:
            return request
        if request_id in self.recently_freed:
            raise ValueError(f"request {request_id!r} was already freed")
        raise NotFoundError(f"unknown request {request_id!r} in session {self.session_id}")

    def add(self, request: Request) -> None:
        self.recently_freed.pop(request.request_id, None)
        self.requests[request.request_id] = request

    def newest(self) -> Request:
        return next(reversed(self.requests.values()))

    def release(self, manager: KVCacheManager, request: Request) -> None:
        """Frees a request's blocks and forgets it."""
        manager.free(request)
        del self.requests[request.request_id]
        self.recently_freed[request.request_id] = None
        if len(self.recently_freed) > _FREED_MEMORY:
            self.recently_freed.popitem(last=False)

    def release_all(self, manager: KVCacheManager) -> int:
        count = len(self.requests)
        for request in list(self.requests.values()):
            self.release(manager, request)
        return count


class SessionRegistry:
    """Attached sessions and their heartbeats.

    Args:
        lease_s: a session not heard from for this long is released.
    """

    def __init__(self, lease_s: float) -> None:
        if lease_s <= 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s}")
        self.lease_s = lease_s
        self.sessions: dict[str, Session] = {}

    def open(self, client_name: str, now: float | None = None) -> Session:
        session = Session(
            session_id=secrets.token_hex(8),
            client_name=client_name,
            last_seen=time.monotonic() if now is None else now,
        )
        self.sessions[session.session_id] = session
        return session

    def get(self, session_id: str, now: float | None = None) -> Session:
        """The live session ``session_id``; renews its lease."""
        session = self.sessions.get(session_id)
        if session is None:
            raise NotFoundError(f"unknown session {session_id!r} (expired or never attached)")
        session.last_seen = time.monotonic() if now is None else now
        return session

    def close(self, session_id: str, manager: KVCacheManager) -> int:
        """Ends a session; returns how many requests it still held."""
        session = self.sessions.pop(session_id, None)
        if session is None:
            raise NotFoundError(f"unknown session {session_id!r}")
        return session.release_all(manager)

    def expired(self, now: float | None = None) -> list[str]:
        now = time.monotonic() if now is None else now
        return [sid for sid, s in self.sessions.items() if now - s.last_seen > self.lease_s]

    @property
    def num_requests(self) -> int:
        return sum(len(s.requests) for s in self.sessions.values())
