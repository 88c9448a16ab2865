"""A random-weight Llama built from a config on the spot: the GPU runs' model.

The GPU machines have no internet and the SmolLM2 weights are too big to carry
there, so the GPU tests and benchmarks use this model: 16 layers, hidden 2048,
32 heads, 8 KV heads, bfloat16 (about a 1B-parameter Llama's shape). Its
tokenizer is a given folder's (SmolLM2's, for real text) or, without one, a
word-level one over numbered tokens (enough for token-id prompts).

    python3 tests/gpu/random_llama.py OUT_DIR [--tokenizer DIR]
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def config(vocab_size: int = 32000):
    """The model's transformers config."""
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=vocab_size, max_position_embeddings=4096, torch_dtype="bfloat16",
        bos_token_id=1, eos_token_id=2,
    )  # fmt: skip


def build(folder: Path, tokenizer_dir: Path | None = None, seed: int = 0, device: str = "cpu"):
    """Writes the model (and a tokenizer) to ``folder``; returns the model (bfloat16, on ``device``:
    initialising 1B parameters takes seconds on a GPU, tens of seconds on a CPU)."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    vocab_size = len(AutoTokenizer.from_pretrained(tokenizer_dir)) if tokenizer_dir else 32000
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(config(vocab_size)).to(torch.bfloat16).eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    if tokenizer_dir:
        for name in TOKENIZER_FILES:
            if (tokenizer_dir / name).exists():
                shutil.copyfile(tokenizer_dir / name, folder / name)
    else:
        _save_word_level_tokenizer(folder, vocab_size)
    return model


def _save_word_level_tokenizer(folder: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="t2", bos_token="t1").save_pretrained(folder)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--tokenizer", type=Path, help="copy this folder's tokenizer (its vocabulary sizes the model)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="where to initialise it")
    args = p.parse_args()
    build(args.out, args.tokenizer, device=args.device)
    print(f"random Llama written to {args.out}", file=sys.stderr)
