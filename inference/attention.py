"""Paged attention for the stock Hugging Face modeling code.

The engine registers these functions through transformers' attention
interface, then runs one flattened ragged batch per step (prefill chunks and
decodes together, ``input_ids`` of shape ``[1, total_tokens]``). Each layer's
attention call writes the new tokens' K/V into their cache slots and reads
every sequence's K/V through its block table.

The flattened batch, for three sequences::

    tokens   | seq0 prefill chunk  | seq1 | seq2 prefill        |
    query_start 0                   5      6                     10
    seq0 context: positions [0, 5)  (first_position 0, 5 new)
    seq1 context: positions [0, 88) (a decode: 87 cached + 1 new)
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from inference.attention_metadata import AttentionMetadata, DecodeBatch, LayerAttention, full_mask
from inference.kernels import cpu
from inference.kernels.launch import BLOCK_MULTIPLE


def store_new_kv(
    layer_idx: int, key: torch.Tensor, value: torch.Tensor, meta: AttentionMetadata | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Writes the new tokens' K and V (``[1, kv_heads, tokens, head_dim]``) into
    their slots; returns the layer's K and V cache views ``[blocks, block_size, kv_heads, head_dim]``."""
    if meta is None:
        raise RuntimeError("paged attention needs attn_metadata; run the model through the engine's ModelRunner")
    layer_k = meta.kv_cache[:, layer_idx, 0]
    layer_v = meta.kv_cache[:, layer_idx, 1]
    if meta.before_write is not None:
        # NOTE: per layer, not only per forward: a process stopped inside a
        # forward (SIGSTOP) for longer than its lease resumes here, and must
        # not write the rest of the forward into blocks that may be another
        # session's by now (kvd/quarantine.py has the daemon's side).
        meta.before_write()
    if meta.write_rows.numel():
        # NOTE: one index_copy_ into the cache seen as contiguous rows: indexing
        # the layer's strided view by (block, offset) pairs cost several times more.
        rows = meta.kv_cache.view(-1, *layer_k.shape[2:])
        block_size = layer_k.shape[1]
        for kind, new in enumerate((key, value)):
            tokens = new[0].transpose(0, 1)  # [tokens, kv_heads, head_dim]
            written = tokens if meta.write_index is None else tokens[meta.write_index]
            rows.index_copy_(0, meta.write_rows + (2 * layer_idx + kind) * block_size, written)
    return layer_k, layer_v


def gather_kv(layer_cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """One sequence's first ``length`` keys or values as ``[length, kv_heads, head_dim]``."""
    # NOTE: index_select copies whole blocks; indexing (layer_cache[block_table]) took twice as long on the CPU.
    blocks = torch.index_select(layer_cache, 0, block_table)  # [n, block_size, kv_heads, head_dim]
    return blocks.flatten(0, 1)[:length]


def torch_paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    attn_metadata: AttentionMetadata | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The reference backend (CPU and GPU): decodes batched, prefill chunks one by one.

    On the CPU, float32 chunks of a plain layer (no soft-capping, no window
    cutting into the context) take the C prefill kernel, all in one call
    reading their blocks in place; the rest torch's SDPA over gathered K/V
    (:func:`_attend`).

    Args:
        query: ``[1, heads, tokens, head_dim]``; key, value: ``[1, kv_heads, tokens, head_dim]``.

    Returns:
        ``[1, tokens, heads, head_dim]`` and no attention weights.
    """
    meta = attn_metadata
    started = time.perf_counter()
    layer_k, layer_v = store_new_kv(module.layer_idx, key, value, meta)
    q = query[0]
    layer = LayerAttention.of_call(q.shape[-1], scaling, kwargs)
    out = torch.empty(q.shape[1], q.shape[0], q.shape[2], dtype=q.dtype, device=q.device)
    looped = meta.looped_seqs
    if looped and layer.softcap is None and cpu.paged_fits(q, layer_k):  # the C kernel: float32 on the CPU
        chunks, tables, looped = meta.paged_chunks(layer.window)
        if chunks.shape[0]:  # all in one call, the blocks read where they lie (inference.kernels.cpu)
            cpu.prefill_chunks(q, layer_k, layer_v, chunks, tables, out, layer.scale)
    for i in looped:
        start, end, context = meta.query_start[i], meta.query_start[i + 1], meta.context_lens[i]
        k = gather_kv(layer_k, meta.block_tables[i], context)
        v = gather_kv(layer_v, meta.block_tables[i], context)
        out[start:end] = _attend(q[:, start:end], k, v, layer, meta.mask(i, layer.window)).transpose(0, 1)
    if meta.decode is not None:
        window_mask = meta.decode_window_mask(layer.window)
        # NOTE: index_copy_/index_select, not indexing: ~5x cheaper per call on the CPU at these sizes.
        out.index_copy_(0, meta.decode.rows, _attend_decodes(q, layer_k, layer_v, meta.decode, layer, window_mask))
    if meta.timings is not None:
        meta.timings.add("attention", time.perf_counter() - started)
    return out.unsqueeze(0), None


def _attend_decodes(
    q: torch.Tensor,
    layer_k: torch.Tensor,
    layer_v: torch.Tensor,
    batch: DecodeBatch,
    layer: LayerAttention,
    window_mask: torch.Tensor | None,
) -> torch.Tensor:
    """One query per sequence over its shared prefix and its own positions.

    Args:
        q: the step's queries ``[heads, tokens, head_dim]``.
        window_mask: :meth:`AttentionMetadata.decode_window_mask` for the layer.

    Returns:
        ``[B, heads, head_dim]``.

    On the CPU a plain layer (no soft-capping, no window cutting into the
    context) takes the fused path (:func:`_attend_decodes_fused`); the
    others take the explicit products of :func:`_attend_decodes_explicit`.
    """
    if q.device.type == "cpu" and layer.softcap is None and window_mask is None:
        return _attend_decodes_fused(q, layer_k, layer_v, batch, layer.scale)
    return _attend_decodes_explicit(q, layer_k, layer_v, batch, layer, window_mask)


#: torch's fused CPU attention, which returns each query's log-sum-exp beside its output.
_cpu_attention_with_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def _attend_decodes_fused(
    q: torch.Tensor, layer_k: torch.Tensor, layer_v: torch.Tensor, batch: DecodeBatch, scale: float
) -> torch.Tensor:
    """:func:`_attend_decodes` over the shared prefix, then each query's own
    positions. With the C kernels (``inference.kernels.cpu``: float32, when
    they could be built) both read the blocks where they lie: the prefix for
    all B queries at once (the queries of each KV head its rows), then each
    query's own blocks carrying on from the prefix's softmax state. Else two
    parts merged by their log-sum-exps: the prefix by torch's fused CPU
    kernel, the own positions by the C decode kernel (when the prefix kernel
    does not take the head dim) or by torch's kernel over the gathered blocks
    (its KV head's queries the rows of one small problem each).

    NOTE: the kernel reads K/V through strides, so the gathered blocks are
    never regrouped by head; the grouped queries need no repeated K/V. It
    measured 3-4x faster per layer than the explicit products on the CPU
    (16 sequences of 656 own positions; benchmarks/vs_vllm.py's noshare).
    """
    heads, _, head_dim = q.shape
    kv_heads = layer_k.shape[2]
    group, n = heads // kv_heads, batch.rows.shape[0]
    queries = q.index_select(1, batch.rows)  # [heads, B, d]; head h reads KV head h // group
    if cpu.fits(q, layer_k):
        by_seq = queries.transpose(0, 1).contiguous()
        prefix = None
        if batch.prefix_blocks.numel() and cpu.paged_fits(q, layer_k):
            # the shared prefix's softmax state, which the own blocks' kernel carries on from: nothing to merge
            prefix = cpu.prefix_decode(by_seq, layer_k, layer_v, batch.prefix_blocks, scale)
        out, lse = cpu.paged_decode(
            by_seq, layer_k, layer_v, batch.own_blocks, batch.own_lens, scale, prefix
        )  # [B, heads, d], [B, heads]: the blocks read where they lie
        if prefix is not None:
            return out
        out, lse = out.view(n, kv_heads, group, head_dim), lse.view(n, kv_heads, group)
    else:
        own_k, own_v = batch.gather_own(layer_k, layer_v)  # [B, S, kv_heads, d]
        by_seq = queries.transpose(0, 1).reshape(n, kv_heads, group, head_dim)
        out, lse = _cpu_attention_with_lse(
            by_seq,
            own_k.transpose(1, 2),
            own_v.transpose(1, 2),
            attn_mask=batch.own_mask[:, None, None, :],
            scale=scale,
        )  # [B, kv_heads, group, d], [B, kv_heads, group]
    if batch.prefix_blocks.numel():
        prefix_k = torch.index_select(layer_k, 0, batch.prefix_blocks).flatten(0, 1)  # [P, kv_heads, d]
        prefix_v = torch.index_select(layer_v, 0, batch.prefix_blocks).flatten(0, 1)
        by_kv_head = queries.view(kv_heads, group, n, head_dim).transpose(1, 2).reshape(1, kv_heads, n * group, -1)
        from_prefix, prefix_lse = _cpu_attention_with_lse(
            by_kv_head, prefix_k.transpose(0, 1)[None], prefix_v.transpose(0, 1)[None], scale=scale
        )
        from_prefix = from_prefix.view(kv_heads, n, group, head_dim).transpose(0, 1)
        prefix_lse = prefix_lse.view(kv_heads, n, group).transpose(0, 1)
        # softmax over both parts = each part's softmax weighted by its share of the total mass
        top = torch.maximum(lse, prefix_lse)
        own_mass, prefix_mass = (lse - top).exp_(), (prefix_lse - top).exp_()
        total = own_mass + prefix_mass
        out = (out * (own_mass / total)[..., None] + from_prefix * (prefix_mass / total)[..., None]).to(q.dtype)
    return out.reshape(n, heads, head_dim)


def _attend_decodes_explicit(
    q: torch.Tensor,
    layer_k: torch.Tensor,
    layer_v: torch.Tensor,
    batch: DecodeBatch,
    layer: LayerAttention,
    window_mask: torch.Tensor | None,
) -> torch.Tensor:
    """:func:`_attend_decodes` as explicit products (soft-capping, windows, GPUs).

    NOTE: every operand stays in the layout its gather produced (whole
    blocks: fast copies), so each product is one ``bmm`` over views:
    - the prefix is gathered once and scored for all B queries, per KV head;
    - a sequence's own positions are scored against every KV head at once
      (``[heads, d] x [S * kv_heads, d]``, a contiguous view) and each query
      head keeps the diagonal, its own KV head's scores. The wasted products
      cost less than regrouping the own K/V by head (measured on the CPU:
      1.05 ms a layer against 1.2 with a loop over heads and 1.5 with a copy).
    One softmax over the concatenated scores keeps this exact (no partial-
    softmax merging).
    """
    heads, _, head_dim = q.shape
    kv_heads = layer_k.shape[2]
    group, n = heads // kv_heads, batch.rows.shape[0]
    prefix_len = batch.prefix_blocks.shape[0] * layer_k.shape[1]
    own_len = batch.own_mask.shape[1]
    queries = q.index_select(1, batch.rows)  # [heads, B, d]
    prefix_k = layer_k[batch.prefix_blocks].view(prefix_len, kv_heads, head_dim)
    prefix_v = layer_v[batch.prefix_blocks].view(prefix_len, kv_heads, head_dim)
    own_k = layer_k[batch.own_blocks].view(n, own_len * kv_heads, head_dim)
    own_v = layer_v[batch.own_blocks].view(n, own_len * kv_heads, head_dim)

    by_kv_head = queries.view(kv_heads, group * n, head_dim)
    prefix_scores = torch.bmm(by_kv_head, prefix_k.permute(1, 2, 0)).view(kv_heads, group, n, prefix_len)
    every_pair = torch.bmm(queries.transpose(0, 1), own_k.transpose(1, 2)).view(n, kv_heads, group, own_len, kv_heads)
    own_scores = every_pair.diagonal(dim1=1, dim2=4)  # [B, g, S, k]
    scores = torch.cat((prefix_scores.transpose(1, 2), own_scores.permute(3, 0, 1, 2)), dim=-1)  # [k, B, g, P + S]
    scores = _capped(scores * layer.scale, layer.softcap)
    scores[..., prefix_len:] += batch.own_mask[:, None, :]
    if window_mask is not None:
        scores += window_mask[:, None, :]
    probs = scores.softmax(dim=-1)

    from_prefix = torch.bmm(probs[..., :prefix_len].reshape(kv_heads, n * group, prefix_len), prefix_v.transpose(0, 1))
    spread = torch.zeros_like(every_pair)  # own probabilities on the diagonal, zero for the other KV heads
    spread.diagonal(dim1=1, dim2=4).copy_(probs[..., prefix_len:].permute(1, 2, 3, 0))
    from_own = torch.bmm(spread.view(n, heads, own_len * kv_heads), own_v).view(n, kv_heads, group, head_dim)
    return (from_own + from_prefix.view(kv_heads, n, group, head_dim).transpose(0, 1)).reshape(n, heads, head_dim)


def _capped(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """Gemma 2's logit soft-capping (``softcap * tanh(scores / softcap)``), on scaled scores."""
    return scores if softcap is None else torch.tanh(scores / softcap) * softcap


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: LayerAttention, mask: torch.Tensor | None
) -> torch.Tensor:
    """Causal attention of the last ``q_len`` positions over ``k_len`` keys.

    Args:
        q: ``[heads, q_len, head_dim]``; k, v: ``[k_len, kv_heads, head_dim]`` (as gathered).
        mask: :func:`chunk_mask` of the chunk for the layer's window.

    Returns:
        ``[heads, q_len, head_dim]``.

    NOTE: SDPA with grouped KV heads (``enable_gqa``) over transposed views:
    its fused kernel skips the masked half of a chunk and never materialises
    the scores; on the CPU it measured 1.3-2.2x faster than grouped einsums
    for prefill chunks of 16-512 tokens over 512-1,016 keys. SDPA cannot
    soft-cap, so a capped layer takes the explicit path.
    """
    if layer.softcap is not None:
        return _attend_capped(q, k, v, layer, mask)
    out = F.scaled_dot_product_attention(
        q[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        attn_mask=mask, is_causal=mask is None and q.shape[1] > 1, scale=layer.scale, enable_gqa=True,
    )  # fmt: skip
    return out[0]


def _attend_capped(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: LayerAttention, mask: torch.Tensor | None
) -> torch.Tensor:
    """:func:`_attend` with the scores soft-capped before masking."""
    heads, q_len, head_dim = q.shape
    kv_heads = k.shape[1]
    by_kv_head = q.reshape(kv_heads, heads // kv_heads * q_len, head_dim)
    scores = torch.bmm(by_kv_head, k.permute(1, 2, 0)).view(heads, q_len, -1)  # [heads, q_len, k_len]
    scores = _capped(scores * layer.scale, layer.softcap)
    if mask is None and q_len > 1:
        mask = full_mask(q_len, k.shape[0], q)  # the square chunk SDPA would mask by its causal flag
    if mask is not None:
        scores += mask
    probs = scores.softmax(dim=-1).view(kv_heads, heads // kv_heads * q_len, -1)
    return torch.bmm(probs, v.transpose(0, 1)).view(heads, q_len, head_dim)


def flash_paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    attn_metadata: AttentionMetadata | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """flash-attn's paged varlen kernel (GPU; block sizes multiple of 256); K/V
    stored by the Triton kernel."""
    from flash_attn import flash_attn_varlen_func

    from inference.kernels.kv_store import store_kv

    step = attn_metadata.step
    layer_k = attn_metadata.kv_cache[:, module.layer_idx, 0]
    layer_v = attn_metadata.kv_cache[:, module.layer_idx, 1]
    store_kv(key[0].transpose(0, 1), value[0].transpose(0, 1), layer_k, layer_v, step.slot_mapping)
    seq_lens = step.seq_lens
    layer = LayerAttention.of_call(query.shape[-1], scaling, kwargs)
    out = flash_attn_varlen_func(
        query[0].transpose(0, 1),
        layer_k,
        layer_v,
        cu_seqlens_q=step.query_start,
        cu_seqlens_k=torch.nn.functional.pad(seq_lens.cumsum(0, dtype=torch.int32), (1, 0)),
        max_seqlen_q=step.launch.max_query_len,
        max_seqlen_k=step.block_table.shape[1] * layer_k.shape[1],
        softmax_scale=layer.scale,
        causal=True,  # bottom-right aligned in flash-attn >= 2.1
        # A query sees itself and the window - 1 keys before it.
        window_size=(layer.window - 1, 0) if layer.window else (-1, -1),
        softcap=layer.softcap or 0.0,
        block_table=step.block_table,
    )
    return out.unsqueeze(0), None


def triton_paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    attn_metadata: AttentionMetadata | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The GPU default: Triton kernels, two launches a layer (store, attend)
    over the step's padded tensors; no host work, no sync.

    ``sliding_window`` and ``softcap`` are what the modeling code of models
    that have them passes (a layer's window, Gemma-style logit soft-capping).
    """
    from inference.kernels.kv_store import store_kv
    from inference.kernels.paged_attention import paged_attention

    meta = attn_metadata
    if meta is None:
        raise RuntimeError("paged attention needs attn_metadata; run the model through the engine's ModelRunner")
    step = meta.step
    layer_k = meta.kv_cache[:, module.layer_idx, 0]
    layer_v = meta.kv_cache[:, module.layer_idx, 1]
    store_kv(key[0].transpose(0, 1), value[0].transpose(0, 1), layer_k, layer_v, step.slot_mapping)
    layer = LayerAttention.of_call(query.shape[-1], scaling, {"sliding_window": sliding_window, "softcap": softcap})
    out = paged_attention(
        query[0].transpose(0, 1), layer_k, layer_v, step.block_table, step.query_start, step.seq_lens, step.launch,
        scale=layer.scale, logit_softcap=layer.softcap, sliding_window=layer.window,
    )  # fmt: skip
    return out.unsqueeze(0), None


BACKENDS = {"torch": "kvd_paged_torch", "triton": "kvd_paged_triton", "flash-attn": "kvd_paged_flash"}
_FUNCTIONS = {"torch": torch_paged_attention, "triton": triton_paged_attention, "flash-attn": flash_paged_attention}
#: Each backend pages with block sizes that are multiples of this (flash-attn
#: reads whole pages of 256 tokens; a Triton tile never straddles two blocks).
BLOCK_MULTIPLES = {"torch": 1, "triton": BLOCK_MULTIPLE, "flash-attn": 256}


def flash_attn_available() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def choose_backend(requested: str, device: str) -> str:
    """The backend to use (``auto``: Triton on CUDA, torch elsewhere);
    registers them all with transformers.

    Raises:
        ValueError: a GPU backend asked for where it cannot run.
    """
    for name, function in _FUNCTIONS.items():
        AttentionInterface.register(BACKENDS[name], function)
    on_gpu = device.startswith("cuda")
    if requested == "flash-attn" and not (on_gpu and flash_attn_available()):
        raise ValueError("--attention-backend flash-attn needs a CUDA device and the flash-attn package")
    if requested == "triton" and not (on_gpu and triton_available()):
        raise ValueError("--attention-backend triton needs a CUDA device and the triton package")
    if requested == "auto":
        return "triton" if on_gpu and triton_available() else "torch"
    return requested


def block_size_fits(backend: str, block_size: int) -> bool:
    """Whether the backend can page with the daemon's block size (checked at attach)."""
    return block_size % BLOCK_MULTIPLES[backend] == 0


def block_size_message(backend: str, block_size: int) -> str:
    multiple = BLOCK_MULTIPLES[backend]
    return (
        f"the {backend} backend needs a block size that is a multiple of {multiple}; "
        f"the daemon uses {block_size} (start it with --block-size {multiple}, or use --attention-backend torch)"
    )
