"""A step's inputs: its chunks turned into padded host arrays, and their one copy to the device.

Only this module builds input ids, positions, slot mappings and block tables:
:func:`build_step_inputs` turns a step's chunks into padded host arrays (a
pure function), :class:`BlockTableRows` keeps each sequence's row of the block
table, and :class:`StepStaging` moves the arrays to the device in one copy
(:func:`step_parts` is their order in it). ``inference.model_runner`` runs the
forward over them; the CUDA graphs replay over static copies of them.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from inference.attention_metadata import StepTensors
from inference.kernels.launch import LaunchShape


@dataclass(frozen=True, slots=True)
class Chunk:
    """A sequence's share of one forward: compute tokens [first, first + len(token_ids)).

    Attributes:
        token_ids: the tokens at those positions.
        first: the position of the first one.
        block_table: the sequence's blocks, covering at least first + len(token_ids).
        write_from: positions below this are already in cached blocks and
            are read, not rewritten (the recomputed last token of a fully
            cached prompt).
        wants_logits: the chunk ends at the sequence's last known token,
            whose logits pick its next one.
        request_id: the sequence's id: its block-table row persists across
            steps while it runs ("": a row for this step only).
        prompt_logits: positions [start, stop) of the chunk whose logits
            score the prompt (its logprobs); their rows come before the
            last position's. (0, 0): none.
    """

    token_ids: list[int]
    first: int
    block_table: list[int]
    write_from: int
    wants_logits: bool
    request_id: str = ""
    prompt_logits: tuple[int, int] = (0, 0)

    @property
    def num_prompt_logits(self) -> int:
        return self.prompt_logits[1] - self.prompt_logits[0]


@dataclass(frozen=True)
class StepInputs:
    """One step's inputs as padded int32 host arrays.

    Tokens are flattened sequence after sequence; padding tokens (past
    ``num_tokens``) have slot -1 and belong to no sequence, padding
    sequences (past ``num_seqs``) have no tokens and length 0.

    Attributes:
        token_ids, positions, slot_mapping: ``[tokens]``; slot
            ``block * block_size + offset``, -1: do not write.
        query_start: ``[seqs + 1]``; seq_lens: ``[seqs]``.
        block_table: ``[seqs, width]``, width covering the longest sequence.
        logit_rows: the flattened rows whose logits are wanted, in order.
    """

    token_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    query_start: np.ndarray
    seq_lens: np.ndarray
    block_table: np.ndarray
    logit_rows: np.ndarray
    num_tokens: int
    num_seqs: int
    max_query_len: int
    max_seq_len: int


def build_step_inputs(
    chunks: Sequence[Chunk],
    block_size: int,
    table_rows: np.ndarray,
    rows: Sequence[int],
    pad_tokens: int = 0,
    pad_seqs: int = 0,
) -> StepInputs:
    """Turns a step's chunks into padded arrays (pure: reads, never writes, its arguments).

    Args:
        table_rows: block ids, chunk i's in row ``rows[i]`` (see :class:`BlockTableRows`).
        pad_tokens, pad_seqs: pad the arrays to at least this many tokens / sequences.
    """
    n = len(chunks)
    q_lens = np.fromiter((len(c.token_ids) for c in chunks), np.int32, n)
    firsts = np.fromiter((c.first for c in chunks), np.int32, n)
    write_from = np.fromiter((c.write_from for c in chunks), np.int32, n)
    wants = np.fromiter((c.wants_logits for c in chunks), bool, n)
    num_tokens, num_seqs = int(q_lens.sum()), max(n, pad_seqs)
    seq_lens = np.zeros(num_seqs, np.int32)
    seq_lens[:n] = firsts + q_lens
    query_start = np.full(num_seqs + 1, num_tokens, np.int32)
    query_start[0] = 0
    np.cumsum(q_lens, out=query_start[1 : n + 1])
    width = max(1, -(-int(seq_lens.max(initial=0)) // block_size))
    block_table = np.zeros((num_seqs, width), np.int32)
    block_table[:n] = table_rows[np.asarray(rows, np.intp), :width]

    total = max(num_tokens, pad_tokens)
    owner = np.repeat(np.arange(n), q_lens)
    positions = np.zeros(total, np.int32)
    positions[:num_tokens] = np.arange(num_tokens) - query_start[owner] + firsts[owner]
    pos = positions[:num_tokens]
    slots = block_table[owner, pos // block_size] * block_size + pos % block_size
    slot_mapping = np.full(total, -1, np.int32)
    slot_mapping[:num_tokens] = np.where(pos >= write_from[owner], slots, -1)
    token_ids = np.zeros(total, np.int32)
    token_ids[:num_tokens] = np.fromiter(itertools.chain.from_iterable(c.token_ids for c in chunks), np.int32)
    return StepInputs(
        token_ids=token_ids,
        positions=positions,
        slot_mapping=slot_mapping,
        query_start=query_start,
        seq_lens=seq_lens,
        block_table=block_table,
        logit_rows=_logit_rows(chunks, query_start, wants),
        num_tokens=num_tokens,
        num_seqs=n,
        max_query_len=int(q_lens.max(initial=0)),
        max_seq_len=int(seq_lens.max(initial=0)),
    )


def _logit_rows(chunks: Sequence[Chunk], query_start: np.ndarray, wants: np.ndarray) -> np.ndarray:
    """The flattened rows whose logits are wanted: each chunk's prompt-scoring
    positions, then its last position when it samples."""
    last_rows = query_start[1 : len(chunks) + 1] - 1
    if not any(c.num_prompt_logits for c in chunks):
        return last_rows[wants]
    rows: list[int] = []
    for i, chunk in enumerate(chunks):
        start, stop = chunk.prompt_logits
        rows.extend(range(query_start[i] + start - chunk.first, query_start[i] + stop - chunk.first))
        if wants[i]:
            rows.append(int(last_rows[i]))
    return np.asarray(rows, np.int32)


class BlockTableRows:
    """Each running sequence's block ids in a host row that persists across
    steps and only grows: a step writes just the blocks a sequence gained.

    A sequence absent from a step (finished, preempted, waiting) gives its row
    back; one whose table is another list than last step's (the scheduler
    gives a preempted sequence a new one) or no longer extends what its row
    holds has its row rewritten.
    """

    def __init__(self, rows: int = 64, width: int = 64) -> None:
        self.table = np.zeros((rows, width), np.int32)
        # request id -> (row, blocks written, the table list they came from: kept
        # alive here, so its identity tells a new table from a grown one)
        self._rows: dict[str, tuple[int, int, list[int]]] = {}
        self._free = list(range(rows - 1, -1, -1))
        self._transient: list[int] = []  # rows of chunks without a request id, for one step

    def assign(self, chunks: Sequence[Chunk]) -> list[int]:
        """Brings the rows up to date with the chunks' tables; returns chunk i's row."""
        previous, self._rows = self._rows, {}
        self._free.extend(self._transient)
        self._transient = []
        rows = []
        for chunk in chunks:
            entry = previous.pop(chunk.request_id, None) if chunk.request_id else None
            row, written, source = entry if entry is not None else (self._take_row(), 0, None)
            blocks = chunk.block_table
            if source is not blocks or written > len(blocks):
                written = 0
            if len(blocks) > self.table.shape[1]:
                self.table = np.pad(self.table, ((0, 0), (0, max(len(blocks), 2 * self.table.shape[1]))))
            self.table[row, written : len(blocks)] = blocks[written:]
            if chunk.request_id:
                self._rows[chunk.request_id] = (row, len(blocks), blocks)
            else:
                self._transient.append(row)
            rows.append(row)
        self._free.extend(row for row, _, _ in previous.values())
        return rows

    def _take_row(self) -> int:
        if not self._free:
            grown = self.table.shape[0]
            self.table = np.pad(self.table, ((0, grown), (0, 0)))
            self._free = list(range(2 * grown - 1, grown - 1, -1))
        return self._free.pop()


class StepStaging:
    """Moves a step's arrays to the device in one copy.

    They are packed into one int32 host buffer (pinned on CUDA, so the copy
    is asynchronous; two alternating, so filling the next step's never
    overwrites bytes a copy may still be reading) and cut into views there.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._buffers: list[torch.Tensor] = [torch.empty(0, dtype=torch.int32)] * 2
        self._turn = 0

    def to_device(self, inputs: StepInputs, launch: LaunchShape) -> tuple[torch.Tensor, ...]:
        """Returns ``(token_ids, positions, logit_rows, StepTensors)`` on the device."""
        parts = step_parts(inputs, inputs.block_table)
        host = self.pack(parts)
        packed = host.to(self.device, non_blocking=True) if self.device.type == "cuda" else host
        ids, positions, slots, query_start, seq_lens, logit_rows, table = packed.split([p.size for p in parts])
        step = StepTensors(slots, query_start, seq_lens, table.view(inputs.block_table.shape), launch)
        return ids, positions, logit_rows, step

    def pack(self, parts: Sequence[np.ndarray]) -> torch.Tensor:
        """The parts, flattened one after another into the next host buffer."""
        host = self._buffer(sum(part.size for part in parts))
        np.concatenate([part.reshape(-1) for part in parts], out=host.numpy())
        return host

    def _buffer(self, size: int) -> torch.Tensor:
        self._turn ^= 1
        buffer = self._buffers[self._turn]
        if buffer.numel() < size:
            pinned = self.device.type == "cuda"
            buffer = torch.empty(max(size, 2 * buffer.numel()), dtype=torch.int32, pin_memory=pinned)
            self._buffers[self._turn] = buffer
        return buffer[:size]


def step_parts(inputs: StepInputs, block_table: np.ndarray) -> tuple[np.ndarray, ...]:
    """A step's arrays in the order one packed copy holds them (the block
    table last: a copy may stop after the rows that are read)."""
    return (inputs.token_ids, inputs.positions, inputs.slot_mapping, inputs.query_start,
            inputs.seq_lens, inputs.logit_rows, block_table)  # fmt: skip
