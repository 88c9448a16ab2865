"""Fixtures of the GPU tests."""

from __future__ import annotations

import pytest
import torch

from inference import model_store
from tests.gpu import random_llama


@pytest.fixture(scope="session")
def random_llama_model(tmp_path_factory):
    """(folder, the model on CUDA): tests/gpu/random_llama.py's, built once per run."""
    folder = tmp_path_factory.mktemp("random-llama")
    return folder, random_llama.build(folder).cuda()


@pytest.fixture(scope="session")
def random_llama_float32(random_llama_model):
    """(folder, the same weights in float32 on CUDA), loaded as the engine loads them."""
    folder, _ = random_llama_model
    return folder, model_store.load_model(folder, torch.float32, "cuda")
