"""Runs one flattened batch through the model on the daemon's KV memory.

Only this module builds input ids, positions, slot mappings and block tables:
:func:`build_step_inputs` turns a step's chunks into padded host arrays (a
pure function), :class:`StepStaging` moves them to the device in one copy,
and attention reads them from ``AttentionMetadata``. The torch backend's
host-side plan (batched decodes, per-sequence tables) is derived from the
same arrays.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from inference.attention import BACKENDS
from inference.attention_metadata import AttentionMetadata, DecodeBatch, StepTensors, chunk_mask
from inference.kernels.launch import LaunchShape, choose_splits

if TYPE_CHECKING:
    from inference.cuda_graphs import StepGraphs

#: Fewer one-token chunks than this are attended to one by one (torch backend).
MIN_DECODE_BATCH = 2


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
        wants_logits: the chunk ends at the sequence's last known token.
        request_id: the sequence's id: its block-table row persists across
            steps while it runs ("": a row for this step only).
    """

    token_ids: list[int]
    first: int
    block_table: list[int]
    write_from: int
    wants_logits: bool
    request_id: str = ""


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
        logit_rows=(query_start[1 : n + 1] - 1)[wants],
        num_tokens=num_tokens,
        num_seqs=n,
        max_query_len=int(q_lens.max(initial=0)),
        max_seq_len=int(seq_lens.max(initial=0)),
    )


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


class ForwardMark:
    """Marks the end of one forward on the device: an interprocess CUDA event
    recorded right after its launch (none on the CPU, where a forward is done
    when ``forward`` returns).

    Attributes:
        handle: the event's IPC handle, for the daemon (b"" on the CPU).
    """

    __slots__ = ("event", "handle")

    def __init__(self, event: torch.cuda.Event | None = None, handle: bytes = b"") -> None:
        self.event = event
        self.handle = handle

    def wait(self) -> None:
        """Returns once the forward's writes have landed."""
        if self.event is not None:
            self.event.synchronize()


#: A finished forward's mark on the CPU.
NO_MARK = ForwardMark()

#: Forward events an engine records into, in turn. Re-recording one is safe
#: once the daemon's waits on its previous record were queued, which happened
#: in the Step that carried it: two are enough; a few more cost nothing.
_FORWARD_EVENTS = 4


def step_parts(inputs: StepInputs, block_table: np.ndarray) -> tuple[np.ndarray, ...]:
    """A step's arrays in the order one packed copy holds them (the block
    table last: a copy may stop after the rows that are read)."""
    return (inputs.token_ids, inputs.positions, inputs.slot_mapping, inputs.query_start,
            inputs.seq_lens, inputs.logit_rows, block_table)  # fmt: skip


class ModelRunner:
    """A causal LM whose attention reads and writes the paged cache.

    Args:
        model: a transformers causal LM whose attention implementation is a
            registered paged backend.
        kv_cache: the mapped cache tensor.
        block_size: tokens per block.
    """

    def __init__(self, model: torch.nn.Module, kv_cache: torch.Tensor, block_size: int) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = next(model.parameters()).device
        self.table_rows = BlockTableRows()
        self.staging = StepStaging(self.device)
        # Called before each layer's K/V writes (the torch backend): the
        # engine's lease check. The GPU backends enqueue their writes at
        # launch and leave this to the daemon's quarantine of lapsed sessions.
        self.before_write: Callable[[], None] | None = None
        on_gpu = self.device.type == "cuda"
        #: multiprocessors the split-KV choice fills (0: never split, the CPU)
        self.num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count if on_gpu else 0
        #: the steps that fit a captured bucket replay its graph (inference/cuda_graphs.py)
        self.graphs: StepGraphs | None = None
        self._marks = [self._new_mark() for _ in range(_FORWARD_EVENTS)] if kv_cache.is_cuda else []
        self._next_mark = 0

    @property
    def backend(self) -> str | None:
        """The model's attention backend, a key of ``BACKENDS`` (a bare module
        in the tests: torch; None: not a paged backend)."""
        config = getattr(self.model, "config", None)
        implementation = getattr(config, "_attn_implementation", BACKENDS["torch"])
        return next((name for name, value in BACKENDS.items() if value == implementation), None)

    def _new_mark(self) -> ForwardMark:
        event = torch.cuda.Event(interprocess=True)  # also never timed: cheap to record
        event.record(torch.cuda.current_stream(self.kv_cache.device))  # a handle needs a recorded event
        return ForwardMark(event, event.ipc_handle())

    def mark_forward(self) -> ForwardMark:
        """Records the end of the forward just launched (see :class:`ForwardMark`)."""
        if not self._marks:
            return NO_MARK
        mark = self._marks[self._next_mark]
        self._next_mark = (self._next_mark + 1) % len(self._marks)
        mark.event.record(torch.cuda.current_stream(self.kv_cache.device))
        return mark

    def wait_for_copies(self, event_handles: list[bytes]) -> None:
        """Makes this process's stream wait for the daemon's copies into the
        cache (interprocess CUDA events), so the next forward reads their bytes."""
        stream = torch.cuda.current_stream(self.kv_cache.device)
        for handle in event_handles:
            stream.wait_event(torch.cuda.Event.from_ipc_handle(self.kv_cache.device, handle))

    def wait_for_writes(self) -> None:
        """Returns once this process's K/V writes so far have landed (a no-op
        on the CPU, where the forward is synchronous)."""
        if self.kv_cache.is_cuda:
            torch.cuda.current_stream(self.kv_cache.device).synchronize()

    @torch.inference_mode()
    def forward(self, chunks: list[Chunk]) -> torch.Tensor:
        """Computes the chunks' K/V into the cache.

        Returns:
            Logits ``[n, vocab]`` (on the model's device) for the chunks that
            want them, in order. A graphed step's are a view of the graphs'
            static output, which the next forward overwrites: read them (or
            enqueue what reads them) before launching the next one.
        """
        if self.graphs is not None:
            logits = self.graphs.forward(chunks)
            if logits is not None:
                return logits
        ids, positions, meta, logit_rows = self._prepare(chunks)
        return self.run_model(ids, positions, meta, logit_rows)

    def run_model(
        self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, logit_rows: torch.Tensor
    ) -> torch.Tensor:
        """The model over one step's device inputs: the logits of ``logit_rows``."""
        # NOTE: the whole causal LM, not its base model and lm_head: families
        # differ in their heads' names (GPT-NeoX's embed_out) and in what they
        # do to the logits (Gemma 2's final soft-capping, Granite's scaling).
        # logits_to_keep as an index tensor (an int 0 would mean every row).
        logits = self.model(
            input_ids=ids[None], position_ids=positions[None], attn_metadata=meta, use_cache=False,
            logits_to_keep=logit_rows,
        ).logits[0]  # fmt: skip
        # Sampling works in at least float32; float64 stays float64 (exactness tests).
        return logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits

    def step_inputs(self, chunks: Sequence[Chunk], pad_tokens: int = 0, pad_seqs: int = 0) -> StepInputs:
        """The chunks' padded host arrays, their block-table rows brought up to date."""
        rows = self.table_rows.assign(chunks)  # first: it may grow the table
        return build_step_inputs(chunks, self.block_size, self.table_rows.table, rows, pad_tokens, pad_seqs)

    def _prepare(self, chunks: list[Chunk]):
        inputs = self.step_inputs(chunks)
        kv_heads = self.kv_cache.shape[4]
        splits = (
            choose_splits(inputs.num_seqs, inputs.max_query_len, inputs.max_seq_len, kv_heads, self.num_sms)
            if self.num_sms
            else 1
        )
        launch = LaunchShape(len(inputs.seq_lens), inputs.max_query_len, splits)
        ids, positions, logit_rows, step = self.staging.to_device(inputs, launch)
        query_start = inputs.query_start[: inputs.num_seqs + 1].tolist()
        context_lens = inputs.seq_lens[: inputs.num_seqs].tolist()
        meta = AttentionMetadata(self.kv_cache, step, query_start, context_lens, before_write=self.before_write)
        if self._reads_torch_plan:
            self._plan_torch(meta, inputs)
        return ids, positions, meta, logit_rows

    @property
    def _reads_torch_plan(self) -> bool:
        return self.backend == "torch"

    def _plan_torch(self, meta: AttentionMetadata, inputs: StepInputs) -> None:
        """The torch backend's host-side plan: per-sequence tables, the written
        rows, batched decodes, causal masks of chunks after cached positions."""
        dev, bs = self.device, self.block_size
        slots = inputs.slot_mapping[: inputs.num_tokens]
        index = np.flatnonzero(slots >= 0)
        written = slots[index].astype(np.int64)
        meta.write_index = torch.from_numpy(index).to(dev)
        meta.write_blocks = torch.from_numpy(written // bs).to(dev)
        meta.write_offsets = torch.from_numpy(written % bs).to(dev)
        widths = [-(-ctx // bs) for ctx in meta.context_lens]
        table = torch.from_numpy(inputs.block_table).to(dev, torch.long)
        meta.block_tables = [table[i, :width] for i, width in enumerate(widths)]  # views of one tensor
        tables = [row[:width] for row, width in zip(inputs.block_table.tolist(), widths, strict=False)]
        meta.decode, meta.looped = self._decode_batch(meta.query_start, meta.context_lens, tables)
        meta.chunk_masks = [
            chunk_mask(end - start, ctx, self.kv_cache)
            for start, end, ctx in zip(meta.query_start, meta.query_start[1:], meta.context_lens, strict=False)
        ]

    def _decode_batch(
        self, query_start: list[int], context_lens: list[int], tables: list[list[int]]
    ) -> tuple[DecodeBatch | None, list[int] | None]:
        """Batches the one-token chunks when padding them wastes little.

        Returns:
            The batch (None: no batching) and the chunks left to the per-sequence loop.
        """
        decodes = [i for i, (start, end) in enumerate(itertools.pairwise(query_start)) if end - start == 1]
        if len(decodes) < MIN_DECODE_BATCH:
            return None, None
        bs = self.block_size
        shortest = min(context_lens[i] for i in decodes)
        prefix = 0  # leading blocks every decode shares, fully inside each one's context
        first = tables[decodes[0]]
        while (prefix + 1) * bs <= shortest and all(tables[i][prefix] == first[prefix] for i in decodes):
            prefix += 1
        own = [context_lens[i] - prefix * bs for i in decodes]
        width = -(-max(own) // bs)  # own blocks of the longest
        if len(decodes) * width * bs > 2 * sum(own) + len(decodes) * bs:
            return None, None  # lengths too uneven: padding would cost more than it saves
        dev = self.device
        own_tables = [tables[i][prefix:] for i in decodes]
        padded = [t + [t[0]] * (width - len(t)) for t in own_tables]  # any block: masked out
        positions = torch.arange(width * bs, device=dev)
        outside = positions[None, :] >= torch.tensor(own, device=dev)[:, None]
        batch = DecodeBatch(
            rows=torch.tensor([query_start[i] for i in decodes], dtype=torch.long, device=dev),
            prefix_blocks=torch.tensor(first[:prefix], dtype=torch.long, device=dev),
            own_blocks=torch.tensor(padded, dtype=torch.long, device=dev),
            own_mask=torch.zeros(outside.shape, dtype=self.kv_cache.dtype, device=dev).masked_fill_(
                outside, float("-inf")
            ),
        )
        batched = set(decodes)
        return batch, [i for i in range(len(context_lens)) if i not in batched]
