"""The dtypes a model or a cache may use: name <-> torch dtype <-> wire enum, in one table.

Shared by the daemon (cache layout), the wire conversions and the engine (model dtype).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvd_api.daemon.v1 import daemon_pb2 as pb


@dataclass(frozen=True, slots=True)
class DType:
    name: str
    torch: torch.dtype
    wire: int  # kvd_api.daemon.v1.DType


DTYPES: tuple[DType, ...] = (
    DType("float64", torch.float64, pb.DTYPE_FLOAT64),
    DType("float32", torch.float32, pb.DTYPE_FLOAT32),
    DType("bfloat16", torch.bfloat16, pb.DTYPE_BFLOAT16),
    DType("float16", torch.float16, pb.DTYPE_FLOAT16),
)
NAMES: tuple[str, ...] = tuple(d.name for d in DTYPES)
_BY_NAME = {d.name: d for d in DTYPES}
_BY_WIRE = {d.wire: d for d in DTYPES}


def by_name(name: str, field: str = "dtype") -> DType:
    """Raises ``ValueError`` naming ``field`` and the choices for an unknown name."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"{field} must be one of {', '.join(NAMES)}; got {name!r}") from None


def by_wire(value: int, field: str = "dtype") -> DType:
    """Raises ``ValueError`` naming ``field`` for an unset or unknown enum value."""
    try:
        return _BY_WIRE[value]
    except KeyError:
        raise ValueError(f"{field} must be set to one of {', '.join(NAMES)}") from None
