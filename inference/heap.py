"""Keeps the memory the engine frees in the process's heap (glibc), set once at start.

A forward allocates its activations afresh, op by op: a 512-token prefill
chunk of SmolLM2 makes a few tensors of 1-3 MiB per layer and frees them a
moment later. glibc hands blocks above its mmap threshold a mapping of their
own (the threshold starts at 128 KiB and follows the largest block freed),
and gives the top of its heap back to the kernel once more than its trim
threshold (twice the mmap threshold) lies free there. Either way the next
tensor's pages are faulted in and zeroed by the kernel again, op after op:
SmolLM2's ``silu`` over 512 tokens took 1.3 ms a layer, most of it in page
faults, against 0.15 ms with the pages kept.

Two ``mallopt`` settings keep them: the mmap threshold at glibc's largest
(32 MiB on 64-bit: rarer, larger blocks still get mappings of their own) and
a trim threshold of 1 GiB. The heap then stays at the forwards' peak, which
it reaches within the first steps anyway. Measured on a 2-core AMD EPYC
(AVX-512), SmolLM2 float32: a 512-token prefill forward took 377 ms against
678, a step of 14 decodes and 512 prompt tokens 434 against 577
(docs/benchmarks.md). vLLM's CPU workers get the same effect by preloading
tcmalloc.

Not applied where the environment sets glibc's malloc tunables itself
(``GLIBC_TUNABLES=glibc.malloc...``), nor outside glibc.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform

log = logging.getLogger(__name__)

#: mallopt's parameter numbers (glibc's malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 32 << 20  # glibc's maximum on 64-bit (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD = 1 << 30


def keep_freed_memory() -> bool:
    """Sets both thresholds for this process; returns whether they were set."""
    if "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        log.info("heap thresholds left to GLIBC_TUNABLES")
        return False
    if platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)  # the C library this process already runs on
    applied = (
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    )
    if applied:
        log.info(
            "freed memory kept in the heap", extra={"mmap_threshold": MMAP_THRESHOLD, "trim_threshold": TRIM_THRESHOLD}
        )
    else:
        log.warning("glibc refused the heap thresholds; freed memory goes back to the kernel as before")
    return applied
