"""One launch per layer writes the step's new K and V into their cache slots."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# slot_mapping is a view of the step's packed inputs: its alignment varies (see paged_attention.py).
@triton.jit(do_not_specialize_on_alignment=["slot_mapping"])
def _store_kv_kernel(
    key, value, k_cache, v_cache, slot_mapping,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_ckb, stride_ckt, stride_ckh, stride_ckd,
    stride_cvb, stride_cvt, stride_cvh, stride_cvd,
    KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0)
    slot = tl.load(slot_mapping + token).to(tl.int64)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    # A slot of -1 (a recomputed cached position, or padding) writes nothing.
    mask = (heads < KV_HEADS) & (dims < HEAD_DIM) & (slot >= 0)
    k = tl.load(key + token * stride_kt + heads * stride_kh + dims * stride_kd, mask=mask)
    v = tl.load(value + token * stride_vt + heads * stride_vh + dims * stride_vd, mask=mask)
    k_dst = k_cache + block * stride_ckb + offset * stride_ckt + heads * stride_ckh + dims * stride_ckd
    v_dst = v_cache + block * stride_cvb + offset * stride_cvt + heads * stride_cvh + dims * stride_cvd
    tl.store(k_dst, k, mask=mask)
    tl.store(v_dst, v, mask=mask)


def store_kv(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Writes token t's K and V to slot ``slot_mapping[t]`` (skipped where -1).

    Args:
        key, value: ``[tokens, kv_heads, head_dim]``, any strides (the model's
            ``[1, kv_heads, tokens, head_dim]`` transposed is fine).
        k_cache, v_cache: one layer's views ``[blocks, block_size, kv_heads, head_dim]``
            of the daemon's cache, written through their strides.
        slot_mapping: ``[tokens]`` int32 or int64, ``block * block_size + offset``.
    """
    tokens, kv_heads, head_dim = key.shape
    if tokens == 0:
        return
    _store_kv_kernel[(tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        *key.stride(), *value.stride(), *k_cache.stride(), *v_cache.stride(),
        KV_HEADS=kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
    )  # fmt: skip
