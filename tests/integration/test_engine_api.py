"""The engine's gRPC API as a client sees it: inputs, outputs, errors."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.tokenizer import GatewayTokenizer
from kvd.common.client import DaemonClient
from kvd_api.engine.v1 import engine_pb2 as pb
from tests.integration.engine_client import generate, request, stub


@pytest.fixture(scope="module")
def engine(shared_stack):
    return stub(shared_stack.address)


def test_info_describes_the_model(engine):
    info = engine.Info(pb.InfoRequest())
    assert (info.block_size, info.max_context, info.vocab_size) == (16, 8192, 49152)
    assert info.dtype == "float32" and info.attention_backend == "torch" and 2 in info.eos_token_ids
    assert info.model_type == "llama"


def test_tokenize_text_and_chat(engine, tokenizer):
    text = engine.Tokenize(pb.TokenizeRequest(text="Hello, world!")).token_ids
    assert list(text) == tokenizer.encode("Hello, world!", add_special_tokens=False)
    chat = pb.ChatPrompt(messages=[pb.ChatMessage(role="user", content="Hi")])
    ids = list(engine.Tokenize(pb.TokenizeRequest(chat=chat)).token_ids)
    assert tokenizer.decode(ids).endswith("<|im_start|>assistant\n")


def test_tokenizer_files_load_the_engines_tokenizer_elsewhere(engine):
    reply = engine.TokenizerFiles(pb.TokenizerFilesRequest())
    assert "tokenizer.json" in reply.files and reply.model == engine.Info(pb.InfoRequest()).model
    loaded = GatewayTokenizer(lambda: dict(reply.files))
    text = "Hello, world! Émile's café — 北京."
    assert loaded.text_ids(text) == list(engine.Tokenize(pb.TokenizeRequest(text=text)).token_ids)
    chat = pb.ChatPrompt(messages=[pb.ChatMessage(role="system", content="Be brief."),
                                   pb.ChatMessage(role="user", content="Hi")])  # fmt: skip
    expected = list(engine.Tokenize(pb.TokenizeRequest(chat=chat)).token_ids)
    assert loaded.chat_ids([("system", "Be brief."), ("user", "Hi")], add_generation_prompt=True) == expected


def test_streamed_text_is_the_decoded_tokens_across_multibyte_characters(engine, tokenizer):
    ids = tokenizer.encode("Écris une phrase en français avec des accents: é, è, à, ç.", add_special_tokens=False)
    tokens, text, final = generate(engine, request(ids, 24))
    assert text == tokenizer.decode(tokens, skip_special_tokens=True)
    assert "\ufffd" not in text and final.finish_reason == pb.FINISH_REASON_LENGTH


def test_chat_generation_stops_at_eos(engine):
    chat = pb.ChatPrompt(messages=[pb.ChatMessage(role="user", content="Say just the word: yes")])
    req = pb.GenerateRequest(chat=chat, sampling=pb.SamplingParams(max_new_tokens=40))
    tokens, text, final = generate(engine, req)
    assert final.finish_reason == pb.FINISH_REASON_EOS and tokens[-1] == 2
    assert "yes" in text.lower() and final.usage.completion_tokens == len(tokens)


def test_a_stop_string_ends_the_output_and_is_not_returned(engine, tokenizer):
    ids = tokenizer.encode("Count: 1, 2, 3, 4, 5, 6, 7,", add_special_tokens=False)
    unstopped, full_text, _ = generate(engine, request(ids, 16))
    assert " 9" in full_text, full_text
    tokens, text, final = generate(engine, request(ids, 16, stop=[" 9"]))
    assert final.finish_reason == pb.FINISH_REASON_STOP
    assert text == full_text[: full_text.index(" 9")]
    # The stop string is found off the engine's loop, maybe a step late: the
    # tokens sampled after it never reach the client, nor its count.
    assert tokens == unstopped[: len(tokens)] and final.usage.completion_tokens == len(tokens)
    assert " 9" in tokenizer.decode(tokens) and " 9" not in tokenizer.decode(tokens[:-1])


def test_seeded_sampling_is_reproducible(engine, tokenizer):
    ids = tokenizer.encode("Once upon a time", add_special_tokens=False)
    sampled = dict(temperature=1.0, top_p=0.95, top_k=50, seed=1234, logprobs=True)
    first, _, _ = generate(engine, request(ids, 16, **sampled))
    second, _, _ = generate(engine, request(ids, 16, **sampled))
    other, _, _ = generate(engine, request(ids, 16, **{**sampled, "seed": 99}))
    assert first == second and first != other


def test_logprobs_are_returned_when_asked(engine, tokenizer):
    ids = tokenizer.encode("The capital of France is", add_special_tokens=False)
    logprobs = []
    for message in engine.Generate(request(ids, 4, logprobs=True)):
        logprobs.extend(message.logprobs)
        assert len(message.logprobs) in (0, len(message.token_ids))
    assert len(logprobs) == 4 and all(lp <= 0 for lp in logprobs)


def test_the_load_stream_reports_queued_work_and_a_measured_rate(engine):
    reports = engine.Load(pb.LoadRequest(), timeout=120)
    first = next(reports)  # at once
    assert first.token_budget > 0
    # A long prompt: while it waits or prefills, its tokens are queued work.
    call = engine.Generate(request(list(range(1000, 1000 + 1500)), 4), timeout=120)
    busy = next(r for r in reports if r.queued_tokens > 0 or r.running > 0)
    assert busy.queued_tokens <= 1500 and busy.running + busy.waiting >= 1
    assert len(list(call)) >= 1
    idle = next(r for r in reports if r.running == 0 and r.waiting == 0)
    assert idle.queued_tokens == 0 and idle.free_blocks > 0
    assert idle.token_s > 0 or idle.forward_s == 0  # measured, or both unknown (0) after a few steps
    reports.cancel()


def test_warm_caches_a_prefix_and_reports_it(shared_stack, engine, tokenizer):
    ids = tokenizer.encode("A template of instructions. " * 8, add_special_tokens=False)
    reply = engine.Warm(pb.WarmRequest(token_ids=ids, cache_salt=b"warm-test"))
    assert reply.cached_tokens == len(ids) // 16 * 16 > 0
    daemon = DaemonClient.connect(shared_stack.daemon.address)
    assert daemon.device_cached_tokens(ids, b"warm-test") == reply.cached_tokens
    _, _, final = generate(engine, pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=ids + [42]), cache_salt=b"warm-test", sampling=pb.SamplingParams(max_new_tokens=2)
    ))  # fmt: skip
    assert final.usage.cached_prompt_tokens == reply.cached_tokens


BAD_REQUESTS = {
    "empty prompt": (pb.GenerateRequest(sampling=pb.SamplingParams()), "prompt"),
    "empty token ids": (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[])), "prompt"),
    "token outside the vocabulary": (request([1, 2, 49152]), "vocabulary"),
    "negative token": (request([1, -2]), "vocabulary"),
    "negative max tokens": (request([1, 2], -1), "max_new_tokens"),
    "prompt top logprobs above 20": (
        request([1, 2], 1, prompt_logprobs=True, prompt_top_logprobs=21),
        "prompt_top_logprobs",
    ),
    "negative temperature": (request([1, 2], 4, temperature=-0.5), "temperature"),
    "top_p zero": (request([1, 2], 4, top_p=0.0), "top_p"),
    "top_p above one": (request([1, 2], 4, top_p=1.5), "top_p"),
    "too long for the context": (request([1] * 8000, 500), "context"),
    # shared_stack's pool: 256 blocks of 16 tokens; 4,000 + 200 need 263
    "more than the whole KV cache": (request([1] * 4000, 200), "KV blocks"),
}


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_bad_requests_are_refused_with_the_field_named(shared_stack, engine, case):
    req, words = BAD_REQUESTS[case]
    with pytest.raises(grpc.RpcError) as err:
        list(engine.Generate(req, timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert words in err.value.details()
    assert DaemonClient.connect(shared_stack.daemon.address).stats().num_requests == 0


def test_health_and_reflection(shared_stack):
    with grpc.insecure_channel(shared_stack.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        reply = health.Check(health_pb2.HealthCheckRequest(service="kvd.engine.v1.Engine"))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_the_metrics_port_times_the_steps_by_phase(shared_stack, engine, tokenizer):
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    def scraped() -> dict[tuple[str, tuple], float]:
        text = urllib.request.urlopen(f"http://127.0.0.1:{shared_stack.metrics_port}/metrics", timeout=10).read()
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text.decode()) for s in family.samples}  # fmt: skip

    before = scraped()
    generate(engine, request(tokenizer.encode("Count to ten:", add_special_tokens=False), 8))
    after = scraped()

    def grew(name: str, **labels) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after[key] - before.get(key, 0.0)

    assert grew("kvd_engine_steps_total", kind="mixed") >= 1  # the prompt
    assert grew("kvd_engine_steps_total", kind="decode") >= 6  # 7 tokens after the first, some may share a step
    assert grew("kvd_engine_step_tokens_total", kind="decode") >= 6
    for phase in ("step_rpc", "sample", "forward", "attention"):
        assert grew("kvd_engine_step_seconds_total", kind="decode", phase=phase) > 0, phase
    assert grew("kvd_engine_step_seconds_total", kind="decode", phase="attention") < grew(
        "kvd_engine_step_seconds_total", kind="decode", phase="forward"
    )
    assert grew("kvd_engine_stream_seconds_total") > 0
