"""How the engine's OpenMP threads wait between parallel regions, set before
torch loads OpenMP, and which thread may start them.

Two settings, each a default the environment may override:

- ``OMP_WAIT_POLICY=PASSIVE``: a worker with nothing to do sleeps instead of
  spinning for long; spinning workers cost 3-5x per step when the cores are
  shared with the daemon, the gateway and the clients.
- ``GOMP_SPINCOUNT=20000`` (libgomp's count, about 0.2 ms): a worker still
  spins that briefly before it sleeps. A forward is a few thousand small
  parallel ops back to back; waking a sleeping worker for each cost ~30% of
  a decode step (SmolLM2, 16 sequences, 2 cores: 135 ms a forward against
  110 ms), while the short spin ends long before an RPC or an idle wait
  would leave the cores to the other processes (benchmarks/vs_vllm.py:
  2.23 -> 2.66 requests/s on its shared workload). A dedicated box may set
  ``OMP_WAIT_POLICY=ACTIVE`` instead.

And one rule: **one lasting thread starts parallel work** (the engine loop).
libgomp gives every thread that starts a parallel region a pool of its own
workers, kept until that thread exits; once the pools hold more threads than
the process has CPUs, every wait spins about a hundred times instead of
``GOMP_SPINCOUNT`` and then sleeps. A model loaded on the main thread and run
on the engine loop made two pools: each thread of a 16-sequence decode
forward then slept ~300 times a forward, which took 50 ms against 35
(SmolLM2, 2 cores). So the load runs in a thread that ends
(``in_passing_thread``), and its pool with it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "20000"}

T = TypeVar("T")


def set_defaults() -> None:
    """Sets each default the environment leaves unset (call before importing torch)."""
    for name, value in DEFAULTS.items():
        os.environ.setdefault(name, value)


def in_passing_thread(work: Callable[[], T], name: str = "engine-load") -> T:
    """``work()`` on a thread that has exited by the time this returns, taking
    the OpenMP pool that work made with it; its result, or its exception raised here."""
    # NOTE: leaving the executor joins its one thread (shutdown(wait=True))
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix=name) as executor:
        outcome = executor.submit(work)
    return outcome.result()
