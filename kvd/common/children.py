"""Child processes that never outlive their parent (Linux's ``PR_SET_PDEATHSIG``).

``stop_with_parent`` is a ``preexec_fn`` for ``subprocess.Popen``: it runs in
the child between fork and exec and asks the kernel to send the child SIGTERM
when its parent dies, however it dies (killed outright, it cannot stop its
children itself). Used by ``kvd-serve`` for the daemon, engines and gateway it
supervises and by the gateway for its embedded Redis.
"""

from __future__ import annotations

import ctypes
import signal
import sys

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def stop_with_parent() -> None:
    """SIGTERM for this (child) process when its parent dies; nothing off Linux."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
