"""Small host values (a step's per-row lists, index tensors, bitmasks) moved to
a tensor's device without a blocking copy: pinned first on a GPU, so the copy
is queued on the stream and the host does not wait for the device; left as
they are on the CPU."""

from __future__ import annotations

import torch


def host_to(like: torch.Tensor, values: list, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A small host list on ``like``'s device without a blocking copy."""
    return to_device(like, torch.tensor(values, dtype=dtype))


def to_device(like: torch.Tensor, host: torch.Tensor) -> torch.Tensor:
    """A host tensor on ``like``'s device without a blocking copy."""
    return host.pin_memory().to(like.device, non_blocking=True) if like.is_cuda else host
