"""One Generate call to an engine, timed as its client sees it.

``stream`` sends a prompt as token ids (greedy, EOS ignored, so every
variant produces the same number of tokens) and notes when the first tokens
arrived and when the stream ended, with the engine's usage; an RPC error is
kept in ``Stream.error`` rather than raised, so a benchmark can report it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import grpc

from kvd_api.engine.v1 import engine_pb2 as pb

#: How long one request may take at the most (a slow CPU run of a long workload).
RPC_TIMEOUT_S = 900.0


@dataclass
class Stream:
    """One Generate call as the client saw it."""

    tokens: list[int] = field(default_factory=list)
    first_token_at: float | None = None
    finished_at: float | None = None
    usage: Any = None
    error: str | None = None


def engine_request(prompt: list[int], new_tokens: int, salt: bytes = b"") -> pb.GenerateRequest:
    return pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=prompt),
        sampling=pb.SamplingParams(max_new_tokens=new_tokens, ignore_eos=True),  # greedy: no temperature
        cache_salt=salt,
    )


def stream(stub, prompt: list[int], new_tokens: int, salt: bytes = b"") -> Stream:
    s = Stream()
    try:
        for message in stub.Generate(engine_request(prompt, new_tokens, salt), timeout=RPC_TIMEOUT_S):
            if message.token_ids and s.first_token_at is None:
                s.first_token_at = time.perf_counter()
            s.tokens.extend(message.token_ids)
            if message.HasField("usage"):
                s.usage = message.usage
        s.finished_at = time.perf_counter()
        if s.usage is None:
            s.error = "the stream ended without usage"
    except grpc.RpcError as err:
        s.error = f"{err.code().name}: {err.details()}"
    return s
