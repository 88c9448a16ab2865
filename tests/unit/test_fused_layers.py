"""The fused Llama-code layers (inference/fused_layers.py) and their kernels:
each kernel against torch's operators, each family's swap against its stock
code, and the swapped model on the engine's paged path."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from transformers.models.llama import modeling_llama as llama

from inference import attention, fused_layers
from inference.kernels import cpu
from inference.model_runner import ModelRunner
from inference.step_inputs import Chunk
from tests.model_families import FAMILIES

pytestmark = pytest.mark.skipif(not cpu.use(True), reason="the C kernels need a C compiler")


#: SmolLM2's widths, and ones that leave a tail past the last vector
WIDTHS = {"rms_norm": (576, 37), "silu_mul": (1536, 21), "head_dim": (64, 80, 12)}


def test_rms_norm_equals_llamas(each_vector_width):
    for width in WIDTHS["rms_norm"]:
        gen = torch.Generator().manual_seed(width)
        norm = llama.LlamaRMSNorm(width, eps=1e-5)
        norm.weight.data = torch.randn(width, generator=gen)
        x = torch.randn(2, 33, width, generator=gen) * 3
        torch.testing.assert_close(cpu.rms_norm(x, norm.weight, 1e-5), norm(x), rtol=1e-5, atol=1e-6)


def test_silu_mul_equals_torchs_over_the_whole_range(each_vector_width):
    for width in WIDTHS["silu_mul"]:
        gen = torch.Generator().manual_seed(width)
        gate = torch.randn(40, width, generator=gen) * 8
        gate[0, :5] = torch.tensor([0.0, -0.0, 100.0, -100.0, -1e30])  # x = 0; e^-|x| underflows
        up = torch.randn(40, width, generator=gen)
        got = cpu.silu_mul(torch.cat([gate, up], dim=1))
        torch.testing.assert_close(got, torch.nn.functional.silu(gate) * up, rtol=2e-6, atol=1e-7)


def test_rotary_rotates_queries_and_keys_in_place_as_llamas_code(each_vector_width):
    for head_dim in WIDTHS["head_dim"]:
        gen = torch.Generator().manual_seed(head_dim)
        tokens, heads, kv_heads = 29, 6, 2
        qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen)
        angles = torch.rand(tokens, head_dim // 2, generator=gen) * 50
        cos, sin = torch.cat([angles.cos()] * 2, dim=1), torch.cat([angles.sin()] * 2, dim=1)
        split = qkv.view(tokens, -1, head_dim).transpose(0, 1)[None]  # [1, heads, tokens, head_dim]
        want_q, want_k = llama.apply_rotary_pos_emb(split[:, :heads], split[:, heads:-kv_heads], cos[None], sin[None])
        values = qkv[:, -kv_heads * head_dim :].clone()

        cpu.rotary(qkv, heads + kv_heads, cos, sin)

        torch.testing.assert_close(split[:, :heads], want_q, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(split[:, heads:-kv_heads], want_k, rtol=1e-5, atol=1e-6)
        assert torch.equal(qkv[:, -kv_heads * head_dim :], values), "the values are not rotated"


#: what each family's stock code lets the swap take: Llama's code only.
#: Mistral's and Qwen2's attention pass their window, Phi-3's MLP is already
#: one product, OLMo 2 normalizes after the sublayers, Gemma's norm scales
#: by 1 + weight, GPT-NeoX has LayerNorm and a plain MLP.
SWAPPED = {
    "llama": {"FusedRMSNorm", "FusedGatedMLP", "FusedAttention"},
    "granite": {"FusedRMSNorm", "FusedGatedMLP", "FusedAttention"},
    "mistral": {"FusedRMSNorm", "FusedGatedMLP"},
    "qwen2": {"FusedRMSNorm", "FusedGatedMLP"},
    "qwen3": {"FusedRMSNorm", "FusedGatedMLP"},
    "phi3": {"FusedRMSNorm"},
    "olmo2": {"FusedGatedMLP"},
    "gemma2": set(),
    "gemma3_text": set(),
    "gpt_neox": set(),
}


def fused_kinds(model: torch.nn.Module) -> set[str]:
    return {type(m).__name__ for m in model.modules() if isinstance(m, fused_layers.FUSED)}


@pytest.mark.parametrize("model_type", FAMILIES)
def test_each_family_swaps_only_llamas_code_and_answers_the_same(model_type):
    torch.manual_seed(0)
    stock = transformers.AutoModelForCausalLM.from_config(FAMILIES[model_type].config(), dtype=torch.float32).eval()
    swapped = copy.deepcopy(stock)
    fused_layers.fuse(swapped)
    assert fused_kinds(swapped) == SWAPPED[model_type]
    ids = torch.randint(3, 200, (2, 37), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want, got = (m(ids, use_cache=False).logits for m in (stock, swapped))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_float64_models_and_engines_without_kernels_keep_the_stock_code():
    config = FAMILIES["llama"].config()
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float64).eval()
    assert fused_layers.fuse(model) == 0
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    try:
        cpu.use(False)
        assert fused_layers.fuse(model) == 0
    finally:
        cpu.use(True)
    assert fused_layers.fuse(model) > 0


def test_the_swapped_model_on_the_paged_cache_answers_as_the_stock_one():
    """Through the engine's path (the torch backend on the paged cache): a
    prefill chunk, then a decode beside another sequence's chunk."""
    torch.manual_seed(0)
    attention.choose_backend("torch", "cpu")
    stock = transformers.AutoModelForCausalLM.from_config(FAMILIES["llama"].config(), dtype=torch.float32).eval()
    swapped = copy.deepcopy(stock)
    assert fused_layers.fuse(swapped)
    for model in (stock, swapped):  # as the engine does: after loading (and swapping)
        model.set_attn_implementation(attention.BACKENDS["torch"])
    config = stock.config
    shape = (16, config.num_hidden_layers, 2, 8, config.num_key_value_heads, config.head_dim)
    runners = [ModelRunner(model, torch.zeros(shape), 8) for model in (stock, swapped)]
    gen = torch.Generator().manual_seed(2)
    a, b = torch.randint(3, 200, (41,), generator=gen).tolist(), torch.randint(3, 200, (30,), generator=gen).tolist()
    steps = [
        [Chunk(a[:40], 0, [0, 1, 2, 3, 4], 0, True, "a")],
        [Chunk(a[40:], 40, [0, 1, 2, 3, 4, 5], 40, True, "a"), Chunk(b, 0, [6, 7, 8, 9], 0, True, "b")],
    ]
    for chunks in steps:
        want, got = (runner.forward(chunks) for runner in runners)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
