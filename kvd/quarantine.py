"""Quarantine: a lapsed session's blocks kept out of reuse while its engine may still write them.

A lease lapses when an engine stops answering, which is not proof that it
stopped writing: an engine stopped (SIGSTOP, a frozen VM, a debugger) *inside*
a forward resumes there and writes the rest of that forward's K/V into the
blocks it was given, whatever the daemon did with them meanwhile. So a lapsed
session is not released at once; its requests (and the references they hold
on their blocks) move here, where no Step reaches them, and the blocks stay
out of the free queue until one of:

1. the engine detaches that session: it does so only after its step loop
   left the forward (and, on a GPU, after its stream's writes landed), so it
   can no longer write;
2. the engine's process is gone: the daemon sees it (same host, same pid
   namespace) and it no longer exists, or its pid now names another process;
3. the engine's process cannot be seen from here (another pid namespace, as
   in separate containers, or another host) and ``hold_s`` passed since the
   lease lapsed.

Under 1 and 2 the guarantee is complete: no block is handed out while the
engine that held it can still write it. Under 3 it is bounded: the engine's
own lease check before each layer's writes (``inference.attention``) leaves
only a stop that lands between that check and the write it guards, and lasts
longer than the lease plus ``hold_s``. Only lease expiry quarantines; a
Detach ends a session at once (the engine says it is done), and so does a
session whose process is already gone when its lease lapses.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvd.cache_manager import KVCacheManager
from kvd.common.process_identity import Liveness, ProcessIdentity, liveness
from kvd.session import Session


@dataclass(slots=True)
class _Held:
    session: Session
    lapsed_at: float


class Quarantine:
    """Lapsed sessions whose blocks are held back from reuse (see the module docstring).

    Args:
        hold_s: how long to hold when the engine's process cannot be seen.
        liveness_of: tells whether a process exists (tests pass their own).
    """

    def __init__(self, hold_s: float, liveness_of: Callable[[ProcessIdentity | None], Liveness] = liveness) -> None:
        if hold_s < 0:
            raise ValueError(f"quarantine hold_s must be >= 0, got {hold_s}")
        self.hold_s = hold_s
        self._liveness_of = liveness_of
        self._held: dict[str, _Held] = {}

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._held

    @property
    def num_sessions(self) -> int:
        return len(self._held)

    @property
    def num_blocks(self) -> int:
        """Block references the held sessions' requests keep (a shared prefix block counts per request)."""
        return sum(held.session.num_blocks_held for held in self._held.values())

    def hold(self, session: Session, now: float) -> None:
        """Keeps a lapsed session's requests, and so their blocks, out of reach."""
        self._held[session.session_id] = _Held(session, now)

    def release(self, session_id: str, manager: KVCacheManager) -> int:
        """Frees a held session's blocks; returns how many requests it held."""
        return self._held.pop(session_id).session.release_all(manager)

    def due(self, now: float) -> list[tuple[str, str]]:
        """Held sessions that can no longer write, with why: their process is
        gone, or it cannot be seen and ``hold_s`` passed."""
        out = []
        for session_id, held in self._held.items():
            alive = self._liveness_of(held.session.process)
            if alive is Liveness.GONE:
                out.append((session_id, "its engine's process is gone"))
            elif alive is Liveness.UNKNOWN and now - held.lapsed_at >= self.hold_s:
                out.append((session_id, f"its engine's process cannot be seen and {self.hold_s:g}s passed"))
        return out
