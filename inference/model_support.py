"""Which model architectures the engine serves, checked before it loads one.

A paged engine that ignores how a family attends (a latent KV, a recurrent
state, a window it does not know of) returns plausible wrong text. So the
engine serves only the families its matrix test shows token-exact against
``transformers`` (tests/integration/test_model_families.py) and refuses every
other model at start, naming its type and the reason.
"""

from __future__ import annotations

#: model_type -> family, each one run token-exact by the family matrix.
VERIFIED_FAMILIES: dict[str, str] = {
    "llama": "Llama (SmolLM2)",
    "mistral": "Mistral",
    "qwen2": "Qwen2",
    "qwen3": "Qwen3",
    "gemma2": "Gemma 2",
    "gemma3_text": "Gemma 3 (text)",
    "phi3": "Phi-3",
    "olmo2": "OLMo 2",
    "granite": "Granite",
    "gpt_neox": "GPT-NeoX",
}

#: The layer kinds whose attention is a plain per-token K/V (the paged cache's).
ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})

#: Families whose layers keep a recurrent state (alone or beside attention).
RECURRENT_MODEL_TYPES = frozenset(
    {
        "mamba", "mamba2", "falcon_mamba", "rwkv", "recurrent_gemma", "xlstm", "jamba", "zamba", "zamba2",
        "bamba", "falcon_h1", "granitemoehybrid", "nemotron_h", "lfm2", "qwen3_next", "minimax",
    }
)  # fmt: skip


class UnsupportedModel(ValueError):
    """A model the engine cannot serve exactly; the message names its type and why."""


def check_supported(config) -> None:
    """Refuses a model whose attention the paged cache cannot make exact.

    Args:
        config: the model's transformers config.

    Raises:
        UnsupportedModel: with the model type and the reason.
    """
    model_type = getattr(config, "model_type", "") or "unknown"
    reason = _unsupported_reason(config, model_type)
    if reason:
        raise UnsupportedModel(f"model type {model_type!r} is not supported: {reason}")


def _unsupported_reason(config, model_type: str) -> str | None:
    if getattr(config, "is_encoder_decoder", False):
        return "it is an encoder-decoder model; the engine serves decoder-only causal LMs"
    if getattr(config, "kv_lora_rank", None):
        return (
            "multi-head latent attention (MLA) caches a compressed latent per token, "
            "not the per-head keys and values the paged cache holds"
        )
    if model_type in RECURRENT_MODEL_TYPES:
        return "its recurrent or hybrid layers keep a per-sequence state the paged cache cannot hold"
    other_layers = set(getattr(config, "layer_types", None) or ()) - ATTENTION_LAYER_TYPES
    if other_layers:
        return (
            f"its layer types {sorted(other_layers)} are not full or sliding-window attention "
            "over per-token keys and values (recurrent, linear or chunked layers)"
        )
    if model_type not in VERIFIED_FAMILIES:
        return (
            "it is not among the families shown token-exact against transformers "
            f"({', '.join(sorted(VERIFIED_FAMILIES))})"
        )
    if getattr(config, "use_bidirectional_attention", False):
        return "its attention is bidirectional (an embedding model), not causal"
    return _batch_dependent_rope(config)


def _batch_dependent_rope(config) -> str | None:
    """Rotary scalings whose frequencies follow the longest position in the
    forward: in a flattened batch that is another request's, so a request's
    tokens would depend on what it is batched with."""
    for params in _rope_parameters(config):
        rope_type = params.get("rope_type") or params.get("type")
        original = params.get("original_max_position_embeddings") or getattr(
            config, "original_max_position_embeddings", None
        )
        grows = rope_type == "longrope" and original and config.max_position_embeddings > original
        if rope_type == "dynamic" or grows:
            return (
                f"its {rope_type!r} rotary scaling changes with the longest sequence in a batch, "
                "so batched requests would not get the tokens they get alone"
            )
    return None


def _rope_parameters(config) -> list[dict]:
    """The config's rotary settings: one dict, or one per layer type (Gemma 3)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if all(isinstance(v, dict) for v in params.values()) and params:
        return list(params.values())
    return [params]
