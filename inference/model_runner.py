"""Runs one flattened batch through the model on the daemon's KV memory.

Only this module builds input ids, positions, slot mappings and block-table
tensors; attention reads them from ``AttentionMetadata``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inference.attention import AttentionMetadata, DecodeBatch, chunk_mask

#: Fewer one-token chunks than this are attended to one by one.
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
    """

    token_ids: list[int]
    first: int
    block_table: list[int]
    write_from: int
    wants_logits: bool


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
            Logits ``[n, vocab]`` for the chunks that want them, in order.
        """
        ids, positions, meta, last = self._prepare(chunks)
        # NOTE: the whole causal LM, not its base model and lm_head: families
        # differ in their heads' names (GPT-NeoX's embed_out) and in what they
        # do to the logits (Gemma 2's final soft-capping, Granite's scaling).
        # An index tensor for logits_to_keep: an int 0 would mean every row.
        keep = torch.tensor(last, dtype=torch.long, device=self.device)
        logits = self.model(
            input_ids=ids, position_ids=positions, attn_metadata=meta, use_cache=False, logits_to_keep=keep
        ).logits[0]
        # Sampling works in at least float32; float64 stays float64 (exactness tests).
        return logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits

    def _prepare(self, chunks: list[Chunk]):
        ids: list[int] = []
        positions: list[int] = []
        query_start = [0]
        context_lens = []
        write_index: list[int] = []
        write_slots: list[int] = []
        last = []
        for chunk in chunks:
            n = len(chunk.token_ids)
            base = len(ids)
            ids.extend(chunk.token_ids)
            span = range(chunk.first, chunk.first + n)
            positions.extend(span)
            query_start.append(base + n)
            context_lens.append(chunk.first + n)
            for offset, position in enumerate(span):
                if position >= chunk.write_from:
                    write_index.append(base + offset)
                    write_slots.append(
                        chunk.block_table[position // self.block_size] * self.block_size + position % self.block_size
                    )
            if chunk.wants_logits:
                last.append(base + n - 1)
        dev = self.device
        slots = torch.tensor(write_slots, dtype=torch.long, device=dev)
        tables = [c.block_table[: -(-ctx // self.block_size)] for c, ctx in zip(chunks, context_lens, strict=True)]
        decode, looped = self._decode_batch(chunks, query_start, context_lens, tables)
        meta = AttentionMetadata(
            kv_cache=self.kv_cache,
            query_start=query_start,
            context_lens=context_lens,
            block_tables=[torch.tensor(t, dtype=torch.long, device=dev) for t in tables],
            write_index=torch.tensor(write_index, dtype=torch.long, device=dev),
            write_blocks=slots // self.block_size,
            write_offsets=slots % self.block_size,
            decode=decode,
            looped=looped,
            chunk_masks=[
                chunk_mask(end - start, ctx, self.kv_cache)
                for start, end, ctx in zip(query_start, query_start[1:], context_lens, strict=False)
            ],
        )
        as_tensor = lambda values: torch.tensor([values], dtype=torch.long, device=dev)  # noqa: E731
        return as_tensor(ids), as_tensor(positions), meta, last

    def _decode_batch(
        self, chunks: list[Chunk], query_start: list[int], context_lens: list[int], tables: list[list[int]]
    ) -> tuple[DecodeBatch | None, list[int] | None]:
        """Batches the one-token chunks when padding them wastes little.

        Returns:
            The batch (None: no batching) and the chunks left to the per-sequence loop.
        """
        decodes = [i for i, c in enumerate(chunks) if len(c.token_ids) == 1]
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
        return batch, [i for i in range(len(chunks)) if i not in batched]
