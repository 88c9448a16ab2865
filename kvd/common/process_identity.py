"""Which process holds a session, and whether it still exists.

An engine names its process when it attaches; the daemon checks later, from
``/proc``, whether that process is still there (``kvd.quarantine`` holds a
lapsed session's blocks until it is not). Only a process on the same host
(boot id) and in the same pid namespace can be seen; any other is UNKNOWN.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from enum import Enum

_PROC = "/proc"


@dataclass(frozen=True, slots=True)
class ProcessIdentity:
    """Names one process across pid reuse: the host's boot, the pid namespace,
    the pid and the process's start time (clock ticks since boot)."""

    boot_id: str
    pid_namespace: str
    pid: int
    start_ticks: int

    @classmethod
    def of_this_process(cls) -> ProcessIdentity | None:
        """This process's identity; None where /proc cannot tell it."""
        return cls.of_pid(os.getpid())

    @classmethod
    def of_pid(cls, pid: int) -> ProcessIdentity | None:
        """The identity of process ``pid`` as seen from here; None where /proc cannot tell it."""
        try:
            return cls(_boot_id(), os.readlink(f"{_PROC}/{pid}/ns/pid"), pid, _state_and_start(str(pid))[1])
        except (OSError, ValueError, IndexError):
            return None


class Liveness(Enum):
    ALIVE = "alive"
    GONE = "gone"
    UNKNOWN = "unknown"  # not visible from here: another host or pid namespace


def liveness(identity: ProcessIdentity | None) -> Liveness:
    """Whether the process ``identity`` names still exists, as far as this process can see."""
    if identity is None or identity.pid <= 0:
        return Liveness.UNKNOWN
    try:
        if identity.boot_id != _boot_id() or identity.pid_namespace != os.readlink(f"{_PROC}/self/ns/pid"):
            return Liveness.UNKNOWN
    except OSError:
        return Liveness.UNKNOWN
    try:
        state, start = _state_and_start(str(identity.pid))
    except (FileNotFoundError, ProcessLookupError):
        return Liveness.GONE
    except (OSError, ValueError, IndexError):
        return Liveness.UNKNOWN
    # NOTE: a zombie's (Z) or dead (X) process's mappings are gone already;
    # another start time means the pid was reused by someone else.
    if state in ("Z", "X") or start != identity.start_ticks:
        return Liveness.GONE
    return Liveness.ALIVE


def _boot_id() -> str:
    with open(f"{_PROC}/sys/kernel/random/boot_id") as f:
        return f.read().strip()


def _state_and_start(pid: str) -> tuple[str, int]:
    with open(f"{_PROC}/{pid}/stat") as f:
        stat = f.read()
    # The command name (field 2) may hold spaces and parentheses: split after its last ")".
    fields = stat[stat.rindex(")") + 2 :].split()
    return fields[0], int(fields[19])  # fields 3 (state) and 22 (starttime)
