"""inference.openmp.in_passing_thread: the OpenMP pool of work done there ends
with its thread, so a later thread's parallel work finds the only pool. Each
case in a fresh interpreter whose main thread never starts parallel work; the
pools are counted from /proc (tests/openmp_pools.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.openmp_pools import settled_idle_workers

# Loads in a passing thread (or on a thread that stays), then keeps a second
# thread alive after its own parallel work, and reports how many threads torch
# runs parallel work on; the parent counts the idle workers meanwhile.
SCRIPT = """
import json, os, sys, threading
from inference import openmp
openmp.set_defaults()
import torch

def parallel_work():
    return torch.ones(2048, 2048).sum().item()  # a few million elements: split over every thread

staying = threading.Event()
if sys.argv[1] == "passing":
    openmp.in_passing_thread(parallel_work)
else:
    threading.Thread(target=lambda: (parallel_work(), staying.wait()), daemon=True).start()
done = threading.Event()
threading.Thread(target=lambda: (parallel_work(), done.set(), staying.wait()), daemon=True).start()
done.wait()
print(json.dumps({"threads": torch.get_num_threads()}), flush=True)
sys.stdin.read()  # until the parent has counted
"""


def pools_workers(mode: str) -> tuple[int, int]:
    """(idle OpenMP workers of the child once settled, torch's thread count there)."""
    child = subprocess.Popen([sys.executable, "-c", SCRIPT, mode], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)  # fmt: skip
    try:
        threads = json.loads(child.stdout.readline())["threads"]
        return settled_idle_workers(child.pid), threads
    finally:
        child.communicate("")


def test_work_in_a_passing_thread_leaves_no_pool_behind():
    passing, threads = pools_workers("passing")
    if threads < 2:
        pytest.skip("one OpenMP thread: no pool to count")
    staying, _ = pools_workers("staying")
    assert staying == 2 * (threads - 1)  # the check sees two pools where two threads stay
    assert passing == threads - 1


def test_its_result_and_its_exception_reach_the_caller():
    from inference import openmp

    assert openmp.in_passing_thread(lambda: 41 + 1) == 42
    with pytest.raises(ZeroDivisionError):
        openmp.in_passing_thread(lambda: 1 / 0)
