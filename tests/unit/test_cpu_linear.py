"""``inference.cpu_linear``: float32 linear layers on oneDNN with packed
weights give nn.Linear's answers to float32 rounding, and only float32 CPU
linears are swapped (float64, the exactness tests' dtype, stays on MKL)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from inference import cpu_linear

pytestmark = pytest.mark.skipif(not cpu_linear.available(), reason="this torch has no oneDNN linear")


class Tiny(nn.Module):
    """An embedding, a body and an output head tied to the embedding, as small causal LMs have."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 32, dtype=dtype)
        self.body = nn.Sequential(nn.Linear(32, 48, dtype=dtype), nn.GELU(), nn.Linear(48, 32, bias=False, dtype=dtype))
        self.head = nn.Linear(32, 64, bias=False, dtype=dtype)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(ids)))


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(5, 32), (1, 7, 32), (2, 3, 32)])
def test_a_packed_linear_equals_the_linear_to_float32_rounding(bias, shape):
    torch.manual_seed(0)
    linear = nn.Linear(32, 48, bias=bias)
    x = torch.randn(shape)
    with torch.inference_mode():
        expected, got = linear(x), cpu_linear.PackedLinear(linear)(x)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_every_float32_linear_is_swapped_and_the_model_answers_the_same():
    torch.manual_seed(0)
    model = Tiny(torch.float32)
    ids = torch.randint(0, 64, (1, 9))
    with torch.inference_mode():
        expected = model(ids)
        assert cpu_linear.pack_linears(model) == 3
        got = model(ids)
    assert [type(m) for m in (model.body[0], model.body[2], model.head)] == [cpu_linear.PackedLinear] * 3
    assert model.embed.weight.dtype == torch.float32  # the tied embedding keeps its own weight
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_a_float64_model_is_left_alone():
    model = Tiny(torch.float64)
    assert cpu_linear.pack_linears(model) == 0
    assert all(type(m) is nn.Linear for m in (model.body[0], model.body[2], model.head))
