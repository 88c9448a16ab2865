"""Llama-code layers on the engine's C kernels (float32 CPU engines).

Hugging Face's Llama code runs a decoder layer's element-wise steps as
chains of torch operators: an RMSNorm is six, the rotary embedding of the
queries and keys ten, a gated MLP's activation two, each a pass over a whole
tensor into a new one. On a 512-token chunk of SmolLM2 they took about a
sixth of the forward; on a decode step of 16 rows the operators' overhead
was as long as their work. Here each step is one C kernel
(``inference.kernels.cpu``), and the projections that read the same input
are one product: queries, keys and values; gate and up.

The swap is by module, like ``inference.cpu_linear``'s, and only where the
module's code is Llama's own: a class whose ``forward`` (and, for attention,
the rotary functions it calls) compiles to the same code as Llama's, whatever
family it belongs to (Mistral's and Qwen2's norms and MLPs are; their
attention, which passes a window, is not). Any other module keeps its own
code. The results differ from the stock code's by float32 rounding (other
orders of summation; a polynomial exponential in SiLU); float64 models, the
exactness tests', are never swapped.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable

import torch
from torch import nn
from transformers.activations import SiLUActivation
from transformers.models.llama import modeling_llama as llama

from inference.kernels import cpu


def _same_code(function: Callable | None, reference: Callable) -> bool:
    """Whether ``function`` compiles to ``reference``'s code: the same
    instructions, names and constants (decorators looked through)."""
    a = getattr(inspect.unwrap(function), "__code__", None) if callable(function) else None
    b = inspect.unwrap(reference).__code__
    return a is not None and (a.co_code, a.co_names, a.co_consts) == (b.co_code, b.co_names, b.co_consts)


def _is_llama_norm(module: nn.Module) -> bool:
    return _same_code(type(module).forward, llama.LlamaRMSNorm.forward)


def _is_llama_mlp(module: nn.Module) -> bool:
    return (
        _same_code(type(module).forward, llama.LlamaMLP.forward)
        and isinstance(module.act_fn, (SiLUActivation, nn.SiLU))
        and all(type(getattr(module, name)) is nn.Linear for name in ("gate_proj", "up_proj", "down_proj"))
    )


def _is_llama_attention(module: nn.Module) -> bool:
    """Llama's attention code, calling Llama's rotary functions, over plain linear projections."""
    family = sys.modules[type(module).__module__]
    helpers = ("apply_rotary_pos_emb", "rotate_half")
    return (
        _same_code(type(module).forward, llama.LlamaAttention.forward)
        and all(_same_code(getattr(family, name, None), getattr(llama, name)) for name in helpers)
        and all(type(getattr(module, name)) is nn.Linear for name in ("q_proj", "k_proj", "v_proj", "o_proj"))
    )


def _stacked(*linears: nn.Linear) -> nn.Linear:
    """One linear layer whose outputs are the given layers' side by side."""
    first = linears[0]
    biases = [linear.bias for linear in linears]
    stacked = nn.Linear(first.in_features, sum(linear.out_features for linear in linears), bias=False, device="meta")
    stacked.weight = nn.Parameter(torch.cat([linear.weight.detach() for linear in linears]), requires_grad=False)
    if any(bias is not None for bias in biases):
        parts = [
            torch.zeros(linear.out_features, dtype=first.weight.dtype) if bias is None else bias.detach()
            for linear, bias in zip(linears, biases, strict=True)
        ]
        stacked.bias = nn.Parameter(torch.cat(parts), requires_grad=False)
    return stacked


class FusedRMSNorm(nn.Module):
    """Llama's RMSNorm in one pass (``cpu.rms_norm``)."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.weight = norm.weight
        self.variance_epsilon = norm.variance_epsilon

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return cpu.rms_norm(hidden_states, self.weight, self.variance_epsilon)


class FusedGatedMLP(nn.Module):
    """Llama's SiLU-gated MLP: gate and up as one product, their activation one pass (``cpu.silu_mul``)."""

    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        self.gate_up_proj = _stacked(mlp.gate_proj, mlp.up_proj)
        self.down_proj = mlp.down_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(cpu.silu_mul(self.gate_up_proj(x)))


class FusedAttention(nn.Module):
    """Llama's attention: queries, keys and values as one product, both
    rotary embeddings one pass over it in place (``cpu.rotary``), then the
    model's attention function on views of it, as the stock code calls it."""

    def __init__(self, attention: nn.Module) -> None:
        super().__init__()
        self.config = attention.config
        self.layer_idx = attention.layer_idx
        self.head_dim = attention.head_dim
        self.num_key_value_groups = attention.num_key_value_groups
        self.scaling = attention.scaling
        self.attention_dropout = attention.attention_dropout
        self.is_causal = attention.is_causal
        self.heads = attention.q_proj.out_features // self.head_dim
        self.kv_heads = attention.k_proj.out_features // self.head_dim
        self.qkv_proj = _stacked(attention.q_proj, attention.k_proj, attention.v_proj)
        self.o_proj = attention.o_proj

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        cache: object | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if cache is not None:
            raise ValueError("fused attention keeps no transformers Cache: run it on the paged cache")
        batch, tokens, _ = hidden_states.shape
        qkv = self.qkv_proj(hidden_states).view(batch * tokens, -1)
        cos, sin = (part.expand(batch, tokens, -1).reshape(-1, self.head_dim) for part in position_embeddings)
        cpu.rotary(qkv, self.heads + self.kv_heads, cos, sin)
        heads = qkv.view(batch, tokens, -1, self.head_dim).transpose(1, 2)  # [batch, all heads, tokens, head_dim]
        query, key, value = heads.split((self.heads, self.kv_heads, self.kv_heads), dim=1)
        attend = llama.ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, llama.eager_attention_forward
        )
        out, weights = attend(self, query, key, value, attention_mask, dropout=0.0, scaling=self.scaling, **kwargs)
        return self.o_proj(out.reshape(batch, tokens, -1).contiguous()), weights


#: the modules ``fuse`` puts in
FUSED = (FusedRMSNorm, FusedGatedMLP, FusedAttention)


def fuse(model: nn.Module) -> int:
    """Swaps ``model``'s Llama-code norms, MLPs and attention for the fused
    ones, where the C kernels run and the model is float32 on the CPU;
    returns how many modules were swapped. Run before
    ``cpu_linear.pack_linears``, which then packs the stacked projections."""
    parameter = next(model.parameters())
    if not cpu.available() or parameter.dtype != torch.float32 or parameter.device.type != "cpu":
        return 0
    fused = {_is_llama_norm: FusedRMSNorm, _is_llama_mlp: FusedGatedMLP, _is_llama_attention: FusedAttention}
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            replacement = next((swap for matches, swap in fused.items() if matches(child)), None)
            if replacement is not None:
                setattr(parent, name, replacement(child))
                swapped += 1
    return swapped
