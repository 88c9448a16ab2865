"""The start-time check: unsupported architectures are refused with their type and the reason."""

from __future__ import annotations

import pytest
import transformers

from inference.app import EngineApp
from inference.config import EngineSettings
from inference.model_support import VERIFIED_FAMILIES, UnsupportedModel, check_supported


@pytest.mark.parametrize(
    ("config_class", "reason"),
    [
        ("DeepseekV3Config", "multi-head latent attention"),
        ("MambaConfig", "recurrent or hybrid"),
        ("Qwen3NextConfig", "recurrent or hybrid"),
        ("Llama4TextConfig", "['chunked_attention']"),
        ("T5Config", "encoder-decoder"),
        ("GPT2Config", "not among the families shown token-exact"),
    ],
)
def test_unsupported_models_are_refused_naming_type_and_reason(config_class, reason):
    config = getattr(transformers, config_class)()
    with pytest.raises(UnsupportedModel) as refused:
        check_supported(config)
    assert f"model type {config.model_type!r}" in str(refused.value)
    assert reason in str(refused.value)


def test_rotary_scaling_that_follows_the_batch_is_refused():
    dynamic = transformers.LlamaConfig(rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(UnsupportedModel, match="'dynamic' rotary scaling changes with the longest sequence"):
        check_supported(dynamic)
    factors = dict(short_factor=[1.0] * 16, long_factor=[2.0] * 16)
    longrope = transformers.Phi3Config(
        hidden_size=128, num_attention_heads=4, max_position_embeddings=8192, original_max_position_embeddings=4096,
        rope_scaling={"rope_type": "longrope", **factors},
    )  # fmt: skip
    with pytest.raises(UnsupportedModel, match="'longrope'"):
        check_supported(longrope)
    check_supported(transformers.LlamaConfig(rope_scaling={"rope_type": "llama3", "factor": 8.0,
        "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}))  # fmt: skip


def test_an_embedding_gemma_is_refused_as_bidirectional():
    with pytest.raises(UnsupportedModel, match="bidirectional"):
        check_supported(transformers.Gemma3TextConfig(use_bidirectional_attention=True))


@pytest.mark.parametrize("config_class", ["LlamaConfig", "Gemma2Config", "Gemma3TextConfig", "Qwen2Config"])
def test_verified_families_pass(config_class):
    config = getattr(transformers, config_class)()
    assert config.model_type in VERIFIED_FAMILIES
    check_supported(config)


def test_the_engine_refuses_at_start_before_loading_weights(tmp_path):
    """(kvd-engine prints the ValueError and exits with 2.)"""
    # A config and no weights: the refusal must come before any load is tried.
    transformers.DeepseekV3Config().save_pretrained(tmp_path)
    settings = EngineSettings(model=str(tmp_path), kvd_address="unix:/nonexistent.sock", listen="127.0.0.1:0")
    with pytest.raises(ValueError, match="model type 'deepseek_v3' is not supported: multi-head latent attention"):
        EngineApp(settings)
