"""The shape of the KV cache, shared by the daemon and every engine."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvd.common import dtypes


@dataclass(frozen=True, slots=True)
class CacheLayout:
    """What one block holds.

    The cache tensor is ``[num_blocks, num_layers, 2, block_size, num_kv_heads,
    head_dim]``: a block is one contiguous region across all layers and K/V,
    so a tier copy moves a block in one piece, and attention reads the
    strided per-layer views ``cache[:, layer, 0]`` (K) and ``cache[:, layer, 1]`` (V).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        dtypes.by_name(self.dtype)

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtypes.by_name(self.dtype).torch

    @property
    def block_shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def block_bytes(self) -> int:
        return math.prod(self.block_shape) * self.torch_dtype.itemsize

    def tensor_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, *self.block_shape)

    def num_blocks_for(self, budget_bytes: int) -> int:
        """How many blocks fit a memory budget.

        Raises:
            ValueError: not even one block fits.
        """
        num_blocks = budget_bytes // self.block_bytes
        if num_blocks < 1:
            raise ValueError(
                f"a memory budget of {budget_bytes} bytes does not fit one block of "
                f"{self.block_bytes} bytes ({self.describe()})"
            )
        return num_blocks

    def same_model(self, other: CacheLayout) -> bool:
        return (self.num_layers, self.num_kv_heads, self.head_dim, self.dtype) == (
            other.num_layers,
            other.num_kv_heads,
            other.head_dim,
            other.dtype,
        )

    def describe(self) -> str:
        return (
            f"layers={self.num_layers} kv_heads={self.num_kv_heads} head_dim={self.head_dim} "
            f"block_size={self.block_size} dtype={self.dtype}"
        )
