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


def reference_generate(model, token_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[list[int]]]:
    """transformers' own greedy generate, EOS disabled: the tokens, and the five
    most likely tokens at each step.

    NOTE: an explicit all-ones attention mask: otherwise prompt tokens equal to
    the pad id (SmolLM2's <|im_end|>) are silently masked out.
    """
    ids = torch.tensor([token_ids], device=model.device)
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=model.config.pad_token_id,
        return_dict_in_generate=True,
        output_logits=True,
    )
    return out.sequences[0, len(token_ids) :].tolist(), [step[0].topk(5).indices.tolist() for step in out.logits]


def reference_greedy(model, token_ids: list[int], max_new_tokens: int) -> list[int]:
    return reference_generate(model, token_ids, max_new_tokens)[0]


def stream_with_top5(engine_stub, token_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[list[int]]]:
    """The engine's greedy tokens and its five most likely tokens at each step."""
    tokens, top5 = [], []
    for message in engine_stub.Generate(request(token_ids, max_new_tokens, top_logprobs=5), timeout=300):
        tokens.extend(message.token_ids)
        top5.extend(list(t.token_ids) for t in message.top_logprobs)
    return tokens, top5


def assert_close_to_reference(
    tokens: list[int], top5: list[list[int]], expected: list[int], expected_top5: list[list[int]]
) -> bool:
    """Identical up to the first divergence, where each side's token is among
    the other's five most likely. Returns whether they are fully identical."""
    divergence = next((i for i, (a, b) in enumerate(zip(tokens, expected, strict=True)) if a != b), None)
    if divergence is None:
        return True
    assert tokens[divergence] in expected_top5[divergence], (divergence, tokens, expected)
    assert expected[divergence] in top5[divergence], (divergence, tokens, expected)
    return False
