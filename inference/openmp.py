"""How the engine's OpenMP threads wait between parallel regions, set before torch loads OpenMP.

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
"""

from __future__ import annotations

import os

DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "20000"}


def set_defaults() -> None:
    """Sets each default the environment leaves unset (call before importing torch)."""
    for name, value in DEFAULTS.items():
        os.environ.setdefault(name, value)
