"""CUDA: daemon + engine on the GPU over CUDA IPC, a random-weight Llama.

The model is built from a config on the spot (no downloads): 16 layers,
hidden 2048, 32 heads, 8 KV heads, bfloat16. bfloat16 is too coarse for exact
equality, so the engine's greedy tokens must match `model.generate` up to the
first divergence, where each side's token is among the other's top-5.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import start_daemon, start_engine
from tests.integration.engine_client import (
    assert_close_to_reference,
    reference_generate,
    stream_with_top5,
    stub,
)

pytestmark = pytest.mark.gpu

NEW_TOKENS = 16


@pytest.fixture(scope="module")
def random_llama(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=32000, max_position_embeddings=4096, torch_dtype="bfloat16",
    )  # fmt: skip
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    folder = tmp_path_factory.mktemp("random-llama")
    model.save_pretrained(folder)
    _save_tokenizer(folder, config.vocab_size)
    return folder, model.cuda().eval()


def _save_tokenizer(folder, vocab_size: int) -> None:
    """A word-level tokenizer over numbered tokens: enough for token-id prompts."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="t2", bos_token="t1").save_pretrained(folder)


def test_engine_on_cuda_matches_generate(random_llama, workdir):
    folder, model = random_llama
    daemon = start_daemon(["--device", "cuda", "--block-size", "16", "--num-blocks", "2048"], f"{workdir}")
    engine = start_engine(daemon, ["--model", str(folder), "--device", "cuda", "--dtype", "bfloat16"], workdir)
    try:
        generator = torch.Generator().manual_seed(1)
        prefix = torch.randint(3, 32000, (300,), generator=generator).tolist()
        prompts = [prefix + torch.randint(3, 32000, (20,), generator=generator).tolist() for _ in range(8)]
        client = stub(engine.address)
        for ids in prompts:
            assert_close_to_reference(
                *stream_with_top5(client, ids, NEW_TOKENS), *reference_generate(model, ids, NEW_TOKENS)
            )
    finally:
        engine.stop()
        daemon.stop()
