"""Fixtures of the GPU tests."""

from __future__ import annotations

import pytest

from tests.gpu import random_llama


@pytest.fixture(scope="session")
def random_llama_model(tmp_path_factory):
    """(folder, the model on CUDA): tests/gpu/random_llama.py's, built once per run."""
    folder = tmp_path_factory.mktemp("random-llama")
    return folder, random_llama.build(folder).cuda()
