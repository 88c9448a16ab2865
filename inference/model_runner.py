"""Runs one flattened batch through the model on the daemon's KV memory.

Its inputs come from ``inference.step_inputs`` (padded host arrays, one copy
to the device); attention reads them from ``AttentionMetadata``. The torch
backend's host-side plan (batched decodes, per-sequence tables) is derived
from the same arrays.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from inference.attention import BACKENDS
from inference.attention_metadata import AttentionMetadata, DecodeBatch, chunk_mask
from inference.kernels.launch import LaunchShape, choose_splits
from inference.step_inputs import BlockTableRows, Chunk, StepInputs, StepStaging, build_step_inputs
from inference.step_timings import StepTimings

if TYPE_CHECKING:
    from inference.cuda_graphs import StepGraphs

#: Fewer one-token chunks than this are attended to one by one (torch backend).
MIN_DECODE_BATCH = 2


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


class ModelRunner:
    """A causal LM whose attention reads and writes the paged cache.

    Args:
        model: a transformers causal LM whose attention implementation is a
            registered paged backend.
        kv_cache: the mapped cache tensor.
        block_size: tokens per block.
        timings: the engine's step timings (``prepare``, and ``attention`` on the CPU).
    """

    def __init__(
        self, model: torch.nn.Module, kv_cache: torch.Tensor, block_size: int, timings: StepTimings | None = None
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.timings = timings
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
        if self.timings is not None:
            self.timings.lap("prepare")
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
        if self.device.type == "cpu":  # elsewhere a call's wall time is its launch's
            meta.timings = self.timings
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
        meta.write_index = None if len(index) == len(slots) else torch.from_numpy(index).to(dev)
        rows_per_block = self.kv_cache.shape[1] * 2 * bs  # every layer's keys and values
        meta.write_rows = torch.from_numpy(written // bs * rows_per_block + written % bs).to(dev)
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
        # Leading blocks every decode shares, before each one's last position:
        # a decode's own part is never empty, even where the cache gave
        # identical sequences (greedy forks) the same full blocks.
        prefix = 0
        first = tables[decodes[0]]
        while (prefix + 1) * bs < shortest and all(tables[i][prefix] == first[prefix] for i in decodes):
            prefix += 1
        own = [context_lens[i] - prefix * bs for i in decodes]
        width = -(-max(own) // bs)  # own blocks of the longest
        if len(decodes) * width * bs > 2 * sum(own) + len(decodes) * bs:
            return None, None  # lengths too uneven: padding would cost more than it saves
        dev = self.device
        own_tables = [tables[i][prefix:] for i in decodes]
        padded = [t + [t[0]] * (width - len(t)) for t in own_tables]  # any block: masked out
        positions = torch.arange(width * bs, device=dev)
        own_lens = torch.tensor(own, dtype=torch.long, device=dev)
        outside = positions[None, :] >= own_lens[:, None]
        batch = DecodeBatch(
            rows=torch.tensor([query_start[i] for i in decodes], dtype=torch.long, device=dev),
            prefix_blocks=torch.tensor(first[:prefix], dtype=torch.long, device=dev),
            own_blocks=torch.tensor(padded, dtype=torch.long, device=dev),
            own_mask=torch.zeros(outside.shape, dtype=self.kv_cache.dtype, device=dev).masked_fill_(
                outside, float("-inf")
            ),
            own_lens=own_lens,
        )
        batched = set(decodes)
        return batch, [i for i in range(len(context_lens)) if i not in batched]
