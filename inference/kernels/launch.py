"""What a kernel launch needs to know on the host: sizes fixed before the forward."""

from __future__ import annotations

from dataclasses import dataclass

#: The block sizes the kernels are tested with are multiples of this (a tile of
#: positions may span blocks: each position looks its block up).
BLOCK_MULTIPLE = 16


@dataclass(frozen=True)
class LaunchShape:
    """What one step's launch needs from the host, known before the forward.

    Attributes:
        num_seqs: rows of the block table and of ``seq_lens``.
        max_query_len: the longest chunk (tiles per sequence).
        num_splits: KV ranges per program (1: no split-KV).
    """

    num_seqs: int
    max_query_len: int
    num_splits: int = 1


def choose_splits(num_seqs: int, max_query_len: int, max_seq_len: int, kv_heads: int, num_sms: int) -> int:
    """Split-KV for decode steps whose programs would not fill the GPU:
    enough ranges to give each multiprocessor about two programs, each range
    at least 256 positions long."""
    if max_query_len > 1:
        return 1
    programs = num_seqs * kv_heads
    if programs >= 2 * num_sms:
        return 1
    return max(1, min(-(-2 * num_sms // programs), max_seq_len // 256, 16))
