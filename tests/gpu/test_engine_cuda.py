"""CUDA: daemon + engine on the GPU over CUDA IPC, a random-weight Llama.

The model is tests/gpu/random_llama.py's (built on the spot, no downloads).
bfloat16 is too coarse for exact equality, so the engine's greedy tokens must
match `model.generate` up to the first divergence, where each side's token is
among the other's top-5.
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


def test_engine_on_cuda_matches_generate(random_llama_model, workdir):
    folder, model = random_llama_model
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
