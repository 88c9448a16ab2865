"""Prompt logprobs through a real engine (SmolLM2, float64) against the
model's own forward over the whole prompt: every position, its top tokens,
chunked prefill, a cached prefix that is recomputed only from the first
position asked for, and max_new_tokens 0 (the prompt only)."""

from __future__ import annotations

import shutil
import tempfile

import pytest
import torch

from kvd_api.engine.v1 import engine_pb2 as pb
from tests.conftest import start_daemon, start_engine
from tests.integration.engine_client import generate, request, stub

BLOCK_SIZE = 16
#: Small: a long prompt is scored over several chunks.
TOKEN_BUDGET = 24
#: float64 through the paged backend against transformers' eager forward,
#: then float32 on the wire (the proto's logprobs): its rounding, no more.
REL = 1e-6


@pytest.fixture(scope="module")
def engine(model_dir):
    folder = tempfile.mkdtemp(prefix="kvd-", dir="/tmp")
    daemon = start_daemon(["--block-size", str(BLOCK_SIZE), "--num-blocks", "64"], folder)
    args = ["--model", str(model_dir), "--dtype", "float64", "--token-budget", str(TOKEN_BUDGET)]
    process = start_engine(daemon, args, folder)
    yield stub(process.address)
    process.stop()
    daemon.stop()
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def prompt(tokenizer) -> list[int]:
    text = "The quick brown fox jumps over the lazy dog. " * 3 + "Then it ran into the forest, where"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > 2 * BLOCK_SIZE + 3 and len(ids) > TOKEN_BUDGET
    return ids


@pytest.fixture(scope="module")
def expected(reference_model, prompt) -> torch.Tensor:
    """The model's log-softmax at every prompt position (row p predicts token p + 1)."""
    with torch.no_grad():
        logits = reference_model(torch.tensor([prompt])).logits[0]
    return torch.log_softmax(logits.double(), dim=-1)


def scored(engine, prompt: list[int], max_new_tokens: int = 0, **sampling) -> list[pb.GenerateResponse]:
    sampling.setdefault("prompt_logprobs", True)
    return list(engine.Generate(request(prompt, max_new_tokens, **sampling), timeout=300))


def check_against(expected: torch.Tensor, prompt: list[int], p: pb.PromptLogprobs, top: int = 0) -> None:
    first = p.first_position
    assert list(p.token_ids) == prompt
    assert len(p.logprobs) == len(prompt) - first
    for i, logprob in enumerate(p.logprobs):
        position = first + i
        row = expected[position - 1]
        assert logprob == pytest.approx(row[prompt[position]].item(), rel=REL, abs=REL), position
        if top:
            values, ids = row.topk(top)
            assert list(p.top_logprobs[i].token_ids) == ids.tolist(), position
            assert list(p.top_logprobs[i].logprobs) == pytest.approx(values.tolist(), rel=REL, abs=REL)
    assert len(p.top_logprobs) == (len(p.logprobs) if top else 0)


def test_the_whole_prompt_is_scored_over_several_chunks_and_nothing_is_generated(engine, prompt, expected):
    messages = scored(engine, prompt, prompt_top_logprobs=3)
    assert messages[0].HasField("prompt_logprobs") and messages[0].prompt_logprobs.first_position == 1
    check_against(expected, prompt, messages[0].prompt_logprobs, top=3)
    assert not any(m.token_ids for m in messages)
    final = messages[-1]
    assert final.finish_reason == pb.FINISH_REASON_LENGTH and final.usage.completion_tokens == 0


def test_the_scores_come_before_the_first_token_and_its_logprob_continues_them(engine, prompt, expected):
    messages = scored(engine, prompt, 2, logprobs=True, top_logprobs=1, prompt_top_logprobs=1)
    assert messages[0].HasField("prompt_logprobs") and not messages[0].token_ids
    check_against(expected, prompt, messages[0].prompt_logprobs, top=1)
    tokens = [t for m in messages for t in m.token_ids]
    assert len(tokens) == 2 and tokens[0] == expected[-1].argmax().item()
    assert sum(m.HasField("prompt_logprobs") for m in messages) == 1


def test_a_cached_prompt_is_recomputed_only_from_the_first_position_asked_for(engine, prompt, expected):
    generate(engine, request(prompt, 1))  # the prompt's full blocks are cached now
    whole = scored(engine, prompt)
    check_against(expected, prompt, whole[0].prompt_logprobs)
    assert whole[-1].usage.cached_prompt_tokens == 0  # every position's logits were computed

    first = 2 * BLOCK_SIZE + 3
    tail = scored(engine, prompt, prompt_logprobs_from=first)
    assert tail[0].prompt_logprobs.first_position == first
    check_against(expected, prompt, tail[0].prompt_logprobs)
    # The blocks before the first position asked for (its logits come from the position before it) came from the cache.
    assert tail[-1].usage.cached_prompt_tokens == 2 * BLOCK_SIZE


def test_a_first_position_past_the_prompt_scores_nothing(engine, prompt):
    messages = scored(engine, prompt[:5], 1, prompt_logprobs_from=5)
    assert messages[0].HasField("prompt_logprobs") and not messages[0].prompt_logprobs.logprobs
    assert [t for m in messages for t in m.token_ids]


def test_bad_prompt_logprob_fields_name_themselves(engine, prompt):
    import grpc

    for sampling, field in (({"prompt_top_logprobs": 21}, "sampling.prompt_top_logprobs"),
                            ({"max_new_tokens": -1}, "sampling.max_new_tokens")):  # fmt: skip
        req = request(prompt, 1, prompt_logprobs=True)
        for name, value in sampling.items():
            setattr(req.sampling, name, value)
        with pytest.raises(grpc.RpcError) as err:
            list(engine.Generate(req, timeout=60))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in err.value.details()
