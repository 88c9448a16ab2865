"""Tiny random-weight models of each family the engine serves, built from configs.

Nothing is downloaded: each model is its family's transformers class with a
small config (two or three layers, float64) that still exercises what sets
the family apart: sliding windows shorter than the test prompts (Mistral,
Qwen2's upper layers, Gemma's alternating local/global layers), soft-capping
and query pre-attention scaling (Gemma 2), q/k norms (Qwen3, OLMo 2),
attention biases (Qwen2), partial rotary and parallel residuals (Phi-3,
GPT-NeoX), Granite's multipliers, head dims of 64, 128 and 256, one KV head
(MQA) and tied embeddings. The tokenizer is a word-level one over numbered
tokens (``t0 t1 ...``) with a chat template of the family's own shape.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

VOCAB = 512
#: Shorter than every matrix prompt, longer than a block: windows cut mid-block.
WINDOW = 20
#: The matrix engines' token budget (CPU and GPU): shorter than every prompt,
#: so each is prefilled in chunks.
TOKEN_BUDGET = 24


@dataclass(frozen=True)
class Family:
    """One architecture: its config class, its settings and a chat template."""

    model_type: str
    config_class: str
    settings: dict = field(default_factory=dict)
    chat_template: str = ""

    def config(self):
        import transformers

        common = dict(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.2,
        )  # fmt: skip
        return getattr(transformers, self.config_class)(**{**common, **self.settings})


def _template(start: str, end: str) -> str:
    """A chat template that wraps each message in ``start`` (with its role) and ``end``."""
    return (
        "{% for m in messages %}" + start + "{{ m['content'] }}" + end + "{% endfor %}"
        "{% if add_generation_prompt %}" + start.replace("{{ m['role'] }}", "assistant") + "{% endif %}"
    )


FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        Family("llama", "LlamaConfig", dict(num_key_value_heads=2, head_dim=64, tie_word_embeddings=True),
               _template("t3 {{ m['role'] }} t4 ", " t5 ")),
        Family("mistral", "MistralConfig", dict(num_key_value_heads=2, sliding_window=WINDOW),
               _template("t6 {{ m['role'] }} ", " t7 ")),
        Family("qwen2", "Qwen2Config",
               dict(num_key_value_heads=2, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1,
                    num_hidden_layers=3),
               _template("t8 {{ m['role'] }} t9 ", " t10 ")),
        Family("qwen3", "Qwen3Config", dict(num_key_value_heads=2, head_dim=128),
               _template("t8 {{ m['role'] }} t9 ", " t10 ")),
        Family("gemma2", "Gemma2Config",
               dict(num_key_value_heads=2, head_dim=256, query_pre_attn_scalar=32, sliding_window=WINDOW,
                    attn_logit_softcapping=5.0, final_logit_softcapping=3.0, hidden_activation="gelu_pytorch_tanh"),
               _template("t11 {{ m['role'] }} t12 ", " t13 ")),
        Family("gemma3_text", "Gemma3TextConfig",
               dict(num_key_value_heads=1, head_dim=64, query_pre_attn_scalar=48, sliding_window=WINDOW,
                    layer_types=["sliding_attention", "full_attention", "sliding_attention"], num_hidden_layers=3),
               _template("t11 {{ m['role'] }} t12 ", " t13 ")),
        Family("phi3", "Phi3Config", dict(num_key_value_heads=4, partial_rotary_factor=0.5, sliding_window=None),
               _template("t14 {{ m['role'] }} ", " t15 ")),
        Family("olmo2", "Olmo2Config", dict(num_key_value_heads=4), _template("t16 {{ m['role'] }} ", " t17 ")),
        Family("granite", "GraniteConfig",
               dict(num_key_value_heads=1, attention_multiplier=0.1, embedding_multiplier=2.0,
                    residual_multiplier=0.5, logits_scaling=2.0),
               _template("t18 {{ m['role'] }} ", " t19 ")),
        Family("gpt_neox", "GPTNeoXConfig", dict(rotary_pct=0.25, use_parallel_residual=True),
               _template("t20 {{ m['role'] }} ", " t21 ")),
    )
}  # fmt: skip


def build(family: Family, folder: Path, seed: int = 0) -> torch.nn.Module:
    """Writes a random-weight model of ``family`` and its tokenizer to ``folder``.

    Returns:
        The model (float64, eval mode): the reference ``generate`` runs on it.
    """
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(family.config(), dtype=torch.float64).eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    save_tokenizer(folder, family.chat_template)
    return model


def save_tokenizer(folder: Path, chat_template: str) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="t0", bos_token="t1", eos_token="t2")
    tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(folder)


def tiny_llama(seed: int = 0) -> torch.nn.Module:
    """A Llama smaller still (float32, 2 layers, head dim 16, GQA 2:1) for the
    tests that run the Triton kernels in their interpreter, where every
    program of a launch is a numpy loop."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
    )  # fmt: skip
    return LlamaForCausalLM(config).eval()
