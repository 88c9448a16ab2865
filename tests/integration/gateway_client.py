"""Helpers for tests that talk to a gateway."""

from __future__ import annotations

from collections.abc import Callable

import grpc
import pytest

from gateway.client import GatewayClient


def status_of(call: Callable[[], object]) -> tuple[grpc.StatusCode, str]:
    """The status code and message a call fails with (it must fail)."""
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details()


def completion(client: GatewayClient, prompt=None, **kwargs):
    """A greedy completion with EOS ignored: (token ids, usage)."""
    kwargs.setdefault("ignore_eos", True)
    kwargs.setdefault("max_new_tokens", 8)
    reply = client.complete(prompt, **kwargs)
    return list(reply.token_ids), reply.usage


def document(tokenizer, num_tokens: int) -> str:
    """Deterministic English text of about ``num_tokens`` tokens."""
    sentence = (
        "The committee reviewed the quarterly report on river traffic, harbour fees and the repair of the "
        "old northern lock, and agreed to meet again after the spring floods. "
    )
    text = sentence
    while len(tokenizer.encode(text, add_special_tokens=False)) < num_tokens:
        text += sentence
    return text
