"""Small helpers for talking to an engine in tests."""

from __future__ import annotations

import grpc
import torch

from kvd_api.engine.v1 import engine_pb2 as pb
from kvd_api.engine.v1 import engine_pb2_grpc as pb_grpc


def stub(address: str) -> pb_grpc.EngineStub:
    return pb_grpc.EngineStub(grpc.insecure_channel(address))


def request(token_ids: list[int], max_new_tokens: int = 16, **sampling) -> pb.GenerateRequest:
    sampling.setdefault("ignore_eos", True)
    return pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=token_ids),
        sampling=pb.SamplingParams(max_new_tokens=max_new_tokens, **sampling),
    )


def generate(
    engine_stub, req: pb.GenerateRequest, timeout_s: float = 300
) -> tuple[list[int], str, pb.GenerateResponse]:
    """Streams one request to the end: (token ids, text, the final message)."""
    tokens: list[int] = []
    text = ""
    last = None
    for message in engine_stub.Generate(req, timeout=timeout_s):
        tokens.extend(message.token_ids)
        text += message.text
        last = message
    assert last is not None and last.finish_reason != pb.FINISH_REASON_UNSPECIFIED
    return tokens, text, last


def reference_greedy(model, token_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy generate, EOS disabled.

    NOTE: an explicit all-ones attention mask: otherwise prompt tokens equal to
    the pad id (SmolLM2's <|im_end|>) are silently masked out.
    """
    ids = torch.tensor([token_ids])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=model.config.pad_token_id,
    )
    return out[0, len(token_ids) :].tolist()
