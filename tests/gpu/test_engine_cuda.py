"""CUDA: daemon + engine on the GPU over CUDA IPC, a random-weight Llama.

The model is tests/gpu/random_llama.py's (built on the spot, no downloads).
The engine's greedy tokens must match `model.generate` up to the first
divergence, where each side's token is among the other's top-5: in bfloat16
(the GPU default, too coarse for exact equality) and in float32, where
(TF32 off, as by default) nearly every output must also be fully identical.
"""

from __future__ import annotations

import concurrent.futures as cf

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


def run_against_generate(folder, model, dtype: str, workdir) -> int:
    """8 prompts sharing a 300-token prefix, submitted together (batched
    decodes over the shared blocks); returns how many are fully identical."""
    daemon = start_daemon(["--device", "cuda", "--block-size", "16", "--num-blocks", "2048"], f"{workdir}")
    engine = start_engine(daemon, ["--model", str(folder), "--device", "cuda", "--dtype", dtype], workdir)
    try:
        generator = torch.Generator().manual_seed(1)
        prefix = torch.randint(3, 32000, (300,), generator=generator).tolist()
        prompts = [prefix + torch.randint(3, 32000, (20,), generator=generator).tolist() for _ in range(8)]
        client = stub(engine.address)
        with cf.ThreadPoolExecutor(len(prompts)) as pool:
            results = list(pool.map(lambda ids: stream_with_top5(client, ids, NEW_TOKENS), prompts))
        return sum(
            assert_close_to_reference(*result, *reference_generate(model, ids, NEW_TOKENS))
            for ids, result in zip(prompts, results, strict=True)
        )
    finally:
        engine.stop()
        daemon.stop()


def test_engine_on_cuda_matches_generate(random_llama_model, workdir):
    folder, model = random_llama_model
    run_against_generate(folder, model, "bfloat16", workdir)


def test_engine_on_cuda_float32_matches_generate_exactly(random_llama_float32, workdir):
    folder, model = random_llama_float32
    identical = run_against_generate(folder, model, "float32", workdir)
    print(f"float32: {identical}/8 identical")
    assert identical >= 7, f"only {identical} of 8 outputs identical to generate in float32"
