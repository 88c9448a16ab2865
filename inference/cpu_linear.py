"""float32 linear layers on oneDNN, their weights packed once (CPU engines).

torch's float32 ``linear`` on the CPU calls MKL's sgemm. On CPUs MKL does not
tune for (an AMD EPYC with AVX-512: docs/benchmarks.md) it ran at about half
the speed of oneDNN, which torch also ships: a SmolLM2 forward's products took
36.7 ms at 16 rows and 399 at 290 through MKL, 13.7 and 172 through oneDNN.
oneDNN wants its weights in a blocked layout of its own; packing them once at
load spares every call the reorder.

A decode step's few rows are another matter: there the products are bound
by reading the weights, which oneDNN does at a fraction of the memory's
bandwidth. With the engine's C kernels built (``inference.kernels.cpu``),
each weight is also packed into that kernel's panels, and calls of up to
``cpu.SMALL_ROWS`` rows go there: at 16 rows SmolLM2's products took 52 ms
against oneDNN's 80 on a 2-core AVX2 box. The price is a second copy of the
weights in memory (``--no-cpu-kernels`` spares it).

The results differ from MKL's by float32 rounding only (another order of
summation). float64 has no oneDNN path and stays on MKL: the exactness tests
run in float64.
"""

from __future__ import annotations

import torch
from torch import nn

from inference.kernels import cpu


def available() -> bool:
    """Whether this torch can run packed oneDNN linears."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class PackedLinear(nn.Module):
    """An ``nn.Linear`` (float32, CPU) whose weight oneDNN packed once and,
    with ``panels``, the small-batch kernel too (for calls of a few rows)."""

    def __init__(self, linear: nn.Linear, panels: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach()))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().contiguous())
        use_panels = panels and self.out_features % cpu.panel_width() == 0
        self.register_buffer("panels", cpu.pack_panels(linear.weight) if use_panels else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.panels is not None and x.numel() <= cpu.SMALL_ROWS * self.in_features:
            return cpu.small_linear(x, self.panels, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def pack_linears(model: nn.Module, panels: bool = False) -> int:
    """Puts every float32 ``nn.Linear`` of ``model`` on the CPU on oneDNN, and
    with ``panels`` (the C kernels run: ``cpu.available()``) on the small-batch
    kernel too; returns how many.

    NOTE: a tied output head (SmolLM2's lm_head shares the embedding's weight)
    gets a packed copy of its own; the embedding keeps the original.
    """
    if not available():
        return 0
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child.weight.dtype == torch.float32 and child.weight.device.type == "cpu":
                setattr(parent, name, PackedLinear(child, panels))
                swapped += 1
    return swapped
