"""How many OpenMP pools a process holds, read from /proc (Linux): libgomp's
idle workers sleep in a futex call made from libgomp's own code, so a thread
blocked in a system call whose instruction pointer lies in libgomp is one of
them. Each pool holds (threads - 1) workers (its master is the thread that
started it, busy elsewhere)."""

from __future__ import annotations

import os
import time


def _libgomp_code(pid: int) -> list[tuple[int, int]]:
    spans = []
    with open(f"/proc/{pid}/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) >= 6 and "libgomp" in fields[5] and "x" in fields[1]:
                start, end = fields[0].split("-")
                spans.append((int(start, 16), int(end, 16)))
    return spans


def idle_workers(pid: int) -> int:
    """Threads of ``pid`` asleep in libgomp now (a spinning worker is not counted)."""
    code = _libgomp_code(pid)
    asleep = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/syscall") as f:
                fields = f.read().split()
        except OSError:  # the thread ended
            continue
        if fields and fields[0] not in ("running", "-1"):
            ip = int(fields[-1], 16)
            asleep += any(start <= ip < end for start, end in code)
    return asleep


def settled_idle_workers(pid: int, timeout_s: float = 30.0) -> int:
    """``idle_workers`` once it reads the same five times in a row, 0.1 s apart
    (workers spin briefly before they sleep), or its largest reading by ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    readings: list[int] = []
    while time.monotonic() < deadline:
        readings.append(idle_workers(pid))
        if len(readings) >= 5 and len(set(readings[-5:])) == 1:
            return readings[-1]
        time.sleep(0.1)
    return max(readings)
