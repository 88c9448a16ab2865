"""Fixtures the unit tests share."""

from __future__ import annotations

import secrets

import pytest
import redis

from gateway.templates import TemplateStore


@pytest.fixture
def store():
    """A template store on the test machine's Redis, under a prefix of its own (removed after)."""
    client = redis.Redis(host="127.0.0.1", port=6379)
    prefix = f"kvd-test-{secrets.token_hex(4)}:"
    yield TemplateStore(client, prefix)
    for key in client.scan_iter(f"{prefix}*"):
        client.delete(key)
