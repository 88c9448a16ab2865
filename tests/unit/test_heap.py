"""inference.heap: the engine's freed tensors stay in the heap, counted in page
faults (not time), each case in a fresh interpreter since the setting is per process."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the thresholds are glibc's")

# Rounds of what a prefill layer does with 512 tokens: tensors of 3 MiB (512 x
# 1536 floats) made, written and freed in turn. Prints the minor page faults
# of ten rounds after five (the heap reaches its peak in the first few).
ROUNDS = """
import json, resource, sys
import torch
from inference import heap
applied = heap.keep_freed_memory() if sys.argv[1] == "keep" else None
def layer():
    tensors = [torch.empty(512, 1536).fill_(1.0) for _ in range(4)]
    while tensors:
        tensors.pop(0)
for _ in range(5):
    layer()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    layer()
print(json.dumps({"applied": applied, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
"""
PAGES_OF_ONE_TENSOR = 512 * 1536 * 4 // 4096


def rounds(mode: str, env: dict[str, str] | None = None) -> dict:
    done = subprocess.run([sys.executable, "-c", ROUNDS, mode], capture_output=True, text=True, env=env, check=True)
    return json.loads(done.stdout.splitlines()[-1])


def test_freed_tensors_are_faulted_in_again_without_it_and_not_with_it():
    default = rounds("default")
    kept = rounds("keep")
    assert kept["applied"] is True
    # glibc's defaults give freed megabytes back: rounds fault their tensors' pages in again
    assert default["faults"] > 4 * PAGES_OF_ONE_TENSOR
    assert kept["faults"] < PAGES_OF_ONE_TENSOR // 4


def test_the_environments_own_malloc_tunables_win():
    env = {**os.environ, "GLIBC_TUNABLES": "glibc.malloc.trim_threshold=131072"}
    assert rounds("keep", env)["applied"] is False
