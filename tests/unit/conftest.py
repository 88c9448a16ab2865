"""Fixtures the unit tests share."""

from __future__ import annotations

import secrets

import pytest
import redis

from gateway.templates import TemplateStore
from inference.kernels import cpu


@pytest.fixture
def store():
    """A template store on the test machine's Redis, under a prefix of its own (removed after)."""
    client = redis.Redis(host="127.0.0.1", port=6379)
    prefix = f"kvd-test-{secrets.token_hex(4)}:"
    yield TemplateStore(client, prefix)
    for key in client.scan_iter(f"{prefix}*"):
        client.delete(key)


@pytest.fixture
def fresh_build(monkeypatch, tmp_path):
    """Each test loads the kernel anew, built into its own cache folder."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cpu.load.cache_clear()
    yield
    cpu.load.cache_clear()
    cpu.use(True)


#: the machine's own vector width, and 256-bit vectors as on a machine without
#: AVX-512 (the same build where it has none): both widths of the linear kernel's panels
VECTOR_BUILDS = {"native": (), "without AVX-512": ("-mno-avx512f",)}


@pytest.fixture(params=VECTOR_BUILDS)
def each_vector_width(request, fresh_build, monkeypatch):
    monkeypatch.setattr(cpu, "FLAGS", cpu.FLAGS + VECTOR_BUILDS[request.param])
    if request.param != "native":
        assert cpu.panel_width() == 8
