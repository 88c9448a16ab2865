"""Fixtures of the GPU tests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from inference import model_store
from tests.gpu import random_llama


@pytest.fixture(scope="session")
def random_llama_folder(tmp_path_factory) -> Path:
    """tests/gpu/random_llama.py's model: ``$KVD_GPU_MODEL`` when set (tests/gpu/run.sh
    builds it once for the tests and the benchmarks), else built here once per run."""
    prebuilt = os.environ.get("KVD_GPU_MODEL")
    if prebuilt and Path(prebuilt, "config.json").exists():
        return Path(prebuilt)
    folder = tmp_path_factory.mktemp("random-llama")
    random_llama.build(folder)
    return folder


@pytest.fixture(scope="session")
def random_llama_model(random_llama_folder):
    """(folder, the model in bfloat16 on CUDA), loaded as the engine loads it
    (its rotary buffers stay float32, as the engine's do)."""
    return random_llama_folder, model_store.load_model(random_llama_folder, torch.bfloat16, "cuda")


@pytest.fixture(scope="session")
def random_llama_float32(random_llama_folder):
    """(folder, the same weights in float32 on CUDA), loaded as the engine loads them."""
    return random_llama_folder, model_store.load_model(random_llama_folder, torch.float32, "cuda")
