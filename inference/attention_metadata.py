"""What one step's attention reads besides Q, K and V: the layer's parameters,
the step's padded device tensors, the host-side plan of the flattened batch, and
its additive masks.

The engine's ``ModelRunner`` builds an ``AttentionMetadata`` once a step (and
the CUDA graphs keep static copies of its ``StepTensors``); every layer's call
into ``inference.attention`` reads it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from inference.kernels.launch import LaunchShape
from inference.step_timings import StepTimings


@dataclass(frozen=True, slots=True)
class LayerAttention:
    """What one layer's attention does differently from plain causal softmax attention.

    Built from what the stock modeling code passes every attention call (the
    same keywords its own SDPA and flash integrations read), so each family's
    own rules (Gemma's alternating local/global layers, ``layer_types``,
    Mistral's global window) decide it, not a copy of them here.

    Attributes:
        scale: multiplies the scores (``head_dim ** -0.5``, Gemma's
            ``query_pre_attn_scalar ** -0.5``, Granite's ``attention_multiplier``).
        window: a query sees only the last ``window`` positions, itself
            included (None: all of them).
        softcap: scores become ``softcap * tanh(scores / softcap)`` before
            masking (Gemma 2; None: not capped).
    """

    scale: float
    window: int | None = None
    softcap: float | None = None

    @classmethod
    def of_call(cls, head_dim: int, scaling: float | None, kwargs: dict) -> LayerAttention:
        return cls(
            scale=scaling if scaling is not None else head_dim**-0.5,
            window=kwargs.get("sliding_window") or None,
            softcap=kwargs.get("softcap") or None,
        )


@dataclass
class DecodeBatch:
    """The step's one-token sequences, attended to in one batched pass.

    Their K/V splits in two: the leading blocks every one of them shares (a
    common prompt prefix: gathered once, one matrix product for all queries)
    and each one's own remaining blocks (gathered whole into a padded batch)::

        seq a  | shared prefix blocks | a's own blocks ...        |
        seq b  | shared prefix blocks | b's own ... | (padding)   |

    Attributes:
        rows: the sequences' query rows in the flattened batch ``[B]``.
        prefix_blocks: the shared leading block ids ``[P]``.
        own_blocks: per sequence, its remaining block ids, padded with any
            block id ``[B, S]``.
        own_mask: added to the scores of the own positions: 0 where a
            position is inside the sequence's context, -inf elsewhere
            ``[B, S * block_size]``.
        own_lens: each sequence's positions after the prefix ``[B]`` (int64).
    """

    rows: torch.Tensor
    prefix_blocks: torch.Tensor
    own_blocks: torch.Tensor
    own_mask: torch.Tensor
    own_lens: torch.Tensor
    _own_buffers: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)

    def gather_own(self, layer_k: torch.Tensor, layer_v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The own blocks' keys and values of one layer ``[B, S * block_size, kv_heads, head_dim]``.

        NOTE: gathered into two buffers made at the first layer and refilled
        by the others: a fresh tensor of this size per layer is a fresh
        mapping of the process's memory on the CPU, whose page faults cost
        more than the copy.
        """
        ids = self.own_blocks.flatten()
        if self._own_buffers is None:
            shape = (ids.shape[0], *layer_k.shape[1:])
            self._own_buffers = (layer_k.new_empty(shape), layer_v.new_empty(shape))
        own_k, own_v = self._own_buffers
        torch.index_select(layer_k, 0, ids, out=own_k)
        torch.index_select(layer_v, 0, ids, out=own_v)
        n = self.own_blocks.shape[0]
        return own_k.view(n, -1, *own_k.shape[2:]), own_v.view(n, -1, *own_v.shape[2:])


@dataclass(frozen=True)
class StepTensors:
    """A step's padded inputs on the model's device (views of one copy).

    Attributes:
        slot_mapping: ``[tokens]`` int32, each token's cache slot
            (``block * block_size + offset``), -1: do not write.
        query_start: ``[seqs + 1]`` int32, where each sequence's tokens start.
        seq_lens: ``[seqs]`` int32, each sequence's positions after the step.
        block_table: ``[seqs, width]`` int32, each sequence's blocks.
        launch: the host-side sizes a kernel launch needs (known before the forward).
    """

    slot_mapping: torch.Tensor
    query_start: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    launch: LaunchShape


@dataclass
class AttentionMetadata:
    """Everything one step's attention needs beyond Q, K and V.

    The GPU backends read ``step``; the torch backend reads the host-side
    plan below it (lists and per-sequence tensors, cheap on the CPU).

    Attributes:
        kv_cache: the daemon's cache ``[blocks, layers, 2, block_size, kv_heads, head_dim]``.
        step: the step's padded device tensors.
        query_start: per sequence, where its tokens start in the flattened
            batch (``num_seqs + 1`` entries).
        context_lens: per sequence, the tokens visible after this step
            (its first position plus its new tokens).
        block_tables: per sequence, its block ids covering ``context_lens``.
        write_index: which flattened tokens get their K/V written (a
            recomputed position of a cached block is read, not rewritten);
            None: every one of them.
        write_rows: each written token's row in the cache seen as rows of
            ``[kv_heads, head_dim]``, for layer 0's keys (a layer's keys and
            values are ``2 * layer`` and ``2 * layer + 1`` blocks of rows further).
        chunk_masks: per sequence, the additive causal mask of a chunk that
            follows cached positions (built once a step, read by every
            layer); None for one query (sees everything) or a chunk that is
            its whole context (plain causal).
        decode: the one-token sequences batched together (None: none are).
        looped: the sequences attended to one by one (all the others).
        before_write: called before each layer writes K/V (the torch
            backend); it raises to stop the forward (the engine's lease check).
        timings: where the torch backend adds the seconds its calls take
            (None: not timed; the CPU only, where those calls are synchronous).
    """

    kv_cache: torch.Tensor
    step: StepTensors
    query_start: list[int]
    context_lens: list[int]
    block_tables: list[torch.Tensor] = field(default_factory=list)
    write_index: torch.Tensor | None = None
    write_rows: torch.Tensor | None = None
    chunk_masks: list[torch.Tensor | None] = field(default_factory=list)
    decode: DecodeBatch | None = None
    looped: list[int] | None = None
    window_masks: dict = field(default_factory=dict)
    paged_plans: dict = field(default_factory=dict)  # paged_chunks' answers, by window
    before_write: Callable[[], None] | None = None
    timings: StepTimings | None = None

    @property
    def looped_seqs(self) -> Sequence[int]:
        """The sequences attended to one by one: ``looped``, or all of them when no decode batch was formed."""
        return range(len(self.context_lens)) if self.looped is None else self.looped

    def mask(self, i: int, window: int | None) -> torch.Tensor | None:
        """Sequence ``i``'s chunk mask for a layer with this window (built
        once a step per window, then shared by the layers that use it)."""
        if window is None or self.context_lens[i] <= window:
            return self.chunk_masks[i]
        key = (i, window)
        if key not in self.window_masks:
            q_len = self.query_start[i + 1] - self.query_start[i]
            self.window_masks[key] = chunk_mask(q_len, self.context_lens[i], self.kv_cache, window)
        return self.window_masks[key]

    def paged_chunks(self, window: int | None) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """The looped sequences' chunks for the C prefill kernel at a layer with
        this window (those whose context the window does not cut into), built
        once a step per window: ``[n, 4]`` int64 rows (first token, tokens,
        positions, where its blocks start in the tables), their block tables
        one after the other, and the looped sequences left to SDPA."""
        if window not in self.paged_plans:
            rows, tables, left, at = [], [], [], 0
            for i in self.looped_seqs:
                if window is not None and self.context_lens[i] > window:
                    left.append(i)  # the window cuts into its context
                    continue
                start = self.query_start[i]
                rows.append((start, self.query_start[i + 1] - start, self.context_lens[i], at))
                tables.append(self.block_tables[i])
                at += self.block_tables[i].shape[0]
            chunks = torch.tensor(rows, dtype=torch.int64).view(-1, 4)
            flat = torch.cat(tables).to(torch.int64) if tables else torch.empty(0, dtype=torch.int64)
            self.paged_plans[window] = (chunks, flat, left)
        return self.paged_plans[window]

    def decode_window_mask(self, window: int | None) -> torch.Tensor | None:
        """The batched decodes' additive mask ``[B, P + S]`` over their
        positions (prefix then own), hiding those before each one's window
        (None: every position is inside it)."""
        if window is None:
            return None
        key = ("decode", window)
        if key not in self.window_masks:
            batch = self.decode
            prefix_len = batch.prefix_blocks.shape[0] * self.kv_cache.shape[3]
            lens = prefix_len + (batch.own_mask == 0).sum(dim=1)
            positions = torch.arange(prefix_len + batch.own_mask.shape[1], device=lens.device)
            hidden = positions[None, :] < (lens - window)[:, None]
            mask = torch.zeros(hidden.shape, dtype=self.kv_cache.dtype, device=lens.device)
            self.window_masks[key] = mask.masked_fill_(hidden, float("-inf")) if hidden.any() else None
        return self.window_masks[key]


def chunk_mask(q_len: int, k_len: int, like: torch.Tensor, window: int | None = None) -> torch.Tensor | None:
    """The additive causal mask ``[q_len, k_len]`` (0 visible, -inf hidden) of
    a chunk whose queries are the last ``q_len`` of ``k_len`` positions, in
    ``like``'s dtype and device; a ``window`` also hides the positions more
    than ``window - 1`` before each query. None when none is needed (one
    query, or a square chunk: SDPA's own causal flag), unless the window
    hides some position."""
    windowed = window is not None and k_len > window
    if (q_len == 1 or q_len == k_len) and not windowed:
        return None
    return full_mask(q_len, k_len, like, window)


def full_mask(q_len: int, k_len: int, like: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """:func:`chunk_mask`, always built."""
    # Bottom-right aligned: query j sits at position k_len - q_len + j.
    hidden = torch.ones(q_len, k_len, dtype=torch.bool, device=like.device).triu_(diagonal=k_len - q_len + 1)
    if window is not None and k_len > window:
        hidden |= torch.ones_like(hidden).tril_(diagonal=k_len - q_len - window)
    return torch.zeros(q_len, k_len, dtype=like.dtype, device=like.device).masked_fill_(hidden, float("-inf"))
