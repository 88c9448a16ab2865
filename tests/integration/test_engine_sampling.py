"""The sampling extras through a real engine (SmolLM2, float64): logit_bias,
repetition_penalty (token for token against transformers' generate),
min_tokens, max_new_tokens_to_context bounded by a small KV cache, and the
sampling a model's generation_config recommends (Info.default_sampling)."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import grpc
import pytest
import torch

from kvd_api.engine.v1 import engine_pb2 as pb
from tests.conftest import start_daemon, start_engine
from tests.integration.engine_client import generate, request, stub
from tests.model_families import FAMILIES, build

BLOCK_SIZE, NUM_BLOCKS = 16, 8
#: The most tokens a request holds here: the cache less the pipelined loop's slot.
CAPACITY = BLOCK_SIZE * NUM_BLOCKS - 1


@pytest.fixture(scope="module")
def engine(model_dir):
    """One float64 engine on a daemon of 8 blocks of 16 tokens (128 tokens: less than the model's context)."""
    folder = tempfile.mkdtemp(prefix="kvd-", dir="/tmp")
    daemon = start_daemon(["--block-size", str(BLOCK_SIZE), "--num-blocks", str(NUM_BLOCKS), "--lease-s", "2"], folder)
    process = start_engine(daemon, ["--model", str(model_dir), "--dtype", "float64"], folder)
    yield stub(process.address)
    process.stop()
    daemon.stop()
    shutil.rmtree(folder, ignore_errors=True)


def test_a_logit_bias_of_100_makes_greedy_choose_that_token_with_the_models_logprob(engine, tokenizer):
    ids = tokenizer.encode("The capital of France is", add_special_tokens=False)
    plain, _, _ = generate(engine, request(ids, 4))
    banana = tokenizer.encode(" banana", add_special_tokens=False)[0]
    assert banana not in plain
    tokens, _, _ = generate(engine, request(ids, 4, logit_bias={banana: 100.0}, logprobs=True))
    assert tokens == [banana] * 4
    first = next(iter(engine.Generate(request(ids, 1, logit_bias={banana: 100.0}, logprobs=True), timeout=60)))
    assert first.logprobs[0] < -5  # the model's own logprob of an unlikely token, not the biased one


def test_repetition_penalty_equals_transformers_generate(engine, tokenizer, reference_model):
    ids = tokenizer.encode("one two three one two three one two three one two", add_special_tokens=False)
    tokens, _, _ = generate(engine, request(ids, 12, repetition_penalty=1.5))
    prompt = torch.tensor([ids])
    expected = reference_model.generate(
        prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12, do_sample=False, repetition_penalty=1.5,
        eos_token_id=None, pad_token_id=reference_model.config.pad_token_id,
    )[0, len(ids):].tolist()  # fmt: skip
    assert tokens == expected
    assert tokens != generate(engine, request(ids, 12))[0]  # the penalty changed the output


def chat(question: str, max_new_tokens: int, **sampling) -> pb.GenerateRequest:
    messages = [pb.ChatMessage(role="user", content=question)]
    return pb.GenerateRequest(
        chat=pb.ChatPrompt(messages=messages), sampling=pb.SamplingParams(max_new_tokens=max_new_tokens, **sampling)
    )


def test_min_tokens_holds_off_end_of_sequence(engine):
    question = "What is the capital of Japan? Answer in one word."
    short, _, final = generate(engine, chat(question, 40))
    assert final.finish_reason == pb.FINISH_REASON_EOS and len(short) < 10
    at_least = len(short) + 8
    tokens, _, final = generate(engine, chat(question, 40, min_tokens=at_least))
    assert len(tokens) >= at_least and final.usage.completion_tokens == len(tokens)
    assert short[-1] not in tokens[:at_least]  # the end-of-sequence token was held off


def test_max_new_tokens_to_context_runs_to_what_the_cache_holds(engine, tokenizer):
    ids = tokenizer.encode("Count slowly: one, two, three,", add_special_tokens=False)
    to_context = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(max_new_tokens_to_context=True, ignore_eos=True)
    )
    tokens, _, final = generate(engine, to_context)
    assert final.finish_reason == pb.FINISH_REASON_LENGTH
    assert len(tokens) == final.usage.completion_tokens == CAPACITY - len(ids) > 64


def test_a_prompt_that_fills_the_context_and_a_stated_length_that_cannot_fit_are_refused(engine):
    full = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=[42] * CAPACITY), sampling=pb.SamplingParams(max_new_tokens_to_context=True)
    )
    with pytest.raises(grpc.RpcError) as refused:
        generate(engine, full)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "fills the context" in refused.value.details()
    with pytest.raises(grpc.RpcError) as refused:
        generate(engine, request([42] * 10, BLOCK_SIZE * NUM_BLOCKS))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "KV blocks" in refused.value.details()


def test_bad_sampling_extras_name_their_field(engine):
    with pytest.raises(grpc.RpcError) as refused:
        generate(engine, request([42] * 4, 4, logit_bias={10**9: 1.0}))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling.logit_bias" in refused.value.details()
    with pytest.raises(grpc.RpcError) as refused:
        generate(engine, request([42] * 4, 4, min_p=1.5))
    assert "sampling.min_p" in refused.value.details()


def test_info_recommends_no_sampling_for_smollm2(engine):
    # Its generation_config.json sets only token ids (a folder that sets some: tests/unit/test_default_sampling.py).
    assert engine.Info(pb.InfoRequest(), timeout=10).default_sampling.ListFields() == []


def test_info_recommends_what_a_models_generation_config_sets():
    folder = tempfile.mkdtemp(prefix="kvd-", dir="/tmp")
    try:
        tiny = Path(folder) / "tiny-llama"
        build(FAMILIES["llama"], tiny)
        config = json.loads((tiny / "generation_config.json").read_text())
        (tiny / "generation_config.json").write_text(json.dumps({**config, "temperature": 0.6, "top_p": 0.9}))
        daemon = start_daemon(["--block-size", "16", "--num-blocks", "16", "--lease-s", "2"], folder)
        process = start_engine(daemon, ["--model", str(tiny), "--dtype", "float64"], folder)
        try:
            recommended = stub(process.address).Info(pb.InfoRequest(), timeout=10).default_sampling
        finally:
            process.stop()
            daemon.stop()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    assert {field.name for field, _ in recommended.ListFields()} == {"temperature", "top_p"}
    assert recommended.temperature == pytest.approx(0.6) and recommended.top_p == pytest.approx(0.9)
