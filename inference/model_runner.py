"""Runs one flattened batch through the model on the daemon's KV memory.

Only this module builds input ids, positions, slot mappings and block-table
tensors; attention reads them from ``AttentionMetadata``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inference.attention import AttentionMetadata


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

    @torch.inference_mode()
    def forward(self, chunks: list[Chunk]) -> torch.Tensor:
        """Computes the chunks' K/V into the cache.

        Returns:
            Logits ``[n, vocab]`` for the chunks that want them, in order.
        """
        ids, positions, meta, last = self._prepare(chunks)
        hidden = self.model.model(
            input_ids=ids, position_ids=positions, attn_metadata=meta, use_cache=False
        ).last_hidden_state
        logits = self.model.lm_head(hidden[0, last])
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
        meta = AttentionMetadata(
            kv_cache=self.kv_cache,
            query_start=query_start,
            context_lens=context_lens,
            block_tables=[
                torch.tensor(c.block_table[: -(-ctx // self.block_size)], dtype=torch.long, device=dev)
                for c, ctx in zip(chunks, context_lens, strict=True)
            ],
            write_index=torch.tensor(write_index, dtype=torch.long, device=dev),
            write_blocks=slots // self.block_size,
            write_offsets=slots % self.block_size,
        )
        as_tensor = lambda values: torch.tensor([values], dtype=torch.long, device=dev)  # noqa: E731
        return as_tensor(ids), as_tensor(positions), meta, last
