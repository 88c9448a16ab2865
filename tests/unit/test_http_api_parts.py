"""The HTTP API's pure parts: request bodies, their translation to the gateway's
request, replies in OpenAI's shapes, statuses and fields of errors, the call's
lifetime and key, and the cache key's routing."""

from __future__ import annotations

import grpc
import pytest
from pydantic import ValidationError

from gateway.http_api.errors import api_error
from gateway.http_api.openai_schemas import MAX_PROMPTS, ChatCompletionRequest, CompletionRequest
from gateway.http_api.openai_translate import Chunks, completion_body, completion_requests, generate_request
from gateway.http_api.prompt_scores import PromptScores, share_prefixes
from gateway.http_api.threads import HttpCall
from gateway.request_errors import RequestError
from gateway.request_path import cache_key_member
from gateway.router import NoReplica, RouteKey, Router, RouterConfig, rendezvous
from gateway.templates import TemplateExists, TemplateNotFound
from gateway.tenants import LimitExceeded, bearer_key
from kvd.common.field_error import FieldError, trailing_field
from kvd_api.engine.v1 import engine_pb2 as epb
from kvd_api.gateway.v1 import gateway_pb2 as pb

CHAT = {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}


@pytest.mark.parametrize(
    "field, value",
    [("n", 129), ("best_of", 2), ("tools", [{"type": "function"}]), ("frequency_penalty", 2.5),
     ("presence_penalty", -3),
     ("response_format", {"type": "xml"}), ("logit_bias", {"a": 5}), ("tool_choice", "sometimes"),
     ("echo", True), ("prompt_logprobs", 1), ("guided_json", 5), ("skip_special_tokens", False),
     ("temperature", 2.5), ("top_logprobs", 21), ("max_tokens", 0), ("min_p", 1.5), ("chat_template", "x")],
)  # fmt: skip
def test_a_chat_field_kvd_does_not_take_is_refused_naming_it(field, value):
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate(
            {**CHAT, field: value, **({"logprobs": True} if field == "top_logprobs" else {})}
        )
    assert field in str(info.value)


def test_no_op_values_of_unimplemented_fields_pass():
    body = ChatCompletionRequest.model_validate({**CHAT, "n": 1, "frequency_penalty": 0, "tools": [], "store": True,
                                                 "unknown_field": 1, "best_of": None})  # fmt: skip
    assert body.n == 1 and body.ignored_fields() == ["unknown_field"]


def test_a_completion_takes_prompts_of_text_or_token_ids():
    (text,) = completion_requests(CompletionRequest(model="m", prompt="Hi"))
    assert text.text == "Hi" and text.sampling.max_new_tokens == 16  # vLLM's default for completions
    assert list(completion_requests(CompletionRequest(model="m", prompt=[1, 2]))[0].token_ids.ids) == [1, 2]
    assert [r.text for r in completion_requests(CompletionRequest(model="m", prompt=["a", "b"]))] == ["a", "b"]
    lists = completion_requests(CompletionRequest(model="m", prompt=[[1], [2, 3]]))
    assert [list(r.token_ids.ids) for r in lists] == [[1], [2, 3]]
    with pytest.raises(ValidationError, match="prompt: empty"):
        CompletionRequest(model="m", prompt=[])
    with pytest.raises(ValidationError, match="at most"):
        CompletionRequest(model="m", prompt=["a"] * (MAX_PROMPTS + 1))


def test_a_chat_request_becomes_the_gateways_request():
    body = ChatCompletionRequest.model_validate(
        {**CHAT, "messages": [{"role": "developer", "content": [{"type": "text", "text": "Be "}, {"type": "text",
         "text": "brief."}]}, {"role": "user", "content": "Hi"}], "max_completion_tokens": 5, "temperature": 0.5,
         "top_p": 0.9, "seed": -1, "stop": "END", "logprobs": True, "top_logprobs": 3, "template": "bot",
         "prompt_cache_key": "conv-1", "ignore_eos": True, "top_k": 4}
    )  # fmt: skip
    out = generate_request(body)
    assert [(m.role, m.content) for m in out.chat.messages] == [("system", "Be \nbrief."), ("user", "Hi")]
    s = out.sampling
    assert (s.max_new_tokens, s.top_p, s.seed, list(s.stop), s.top_logprobs, s.top_k) == (
        5,
        pytest.approx(0.9),
        2**64 - 1,
        ["END"],
        3,
        4,
    )
    assert s.logprobs and s.ignore_eos and out.template == "bot" and out.cache_key == "conv-1"


def _reply(text: str, ids: list[int], usage: bool) -> pb.GenerateResponse:
    out = pb.GenerateResponse(text=text, token_ids=ids, logprobs=[-0.5] * len(ids))
    if usage:
        out.finish_reason = epb.FINISH_REASON_LENGTH
        out.usage.CopyFrom(pb.Usage(prompt_tokens=40, cached_prompt_tokens=32, completion_tokens=2,
                                    template_tokens=20, host_cached_prompt_tokens=16))  # fmt: skip
    return out


def test_a_whole_reply_has_openais_usage_with_the_caches_share():
    body = completion_body([_reply("ab", [1, 2], True)], chat=True, model="m", want_logprobs=True, token_text=str)
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "ab"}
    assert body["choices"][0]["finish_reason"] == "length"
    assert [e["token"] for e in body["choices"][0]["logprobs"]["content"]] == ["1", "2"]
    usage = body["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (40, 2, 42)
    assert usage["prompt_tokens_details"]["cached_tokens"] == 32
    assert usage["kvd"]["template_tokens"] == 20 and usage["kvd"]["host_cached_tokens"] == 16


def test_stream_chunks_open_with_the_role_and_end_with_the_finish_and_the_usage():
    chunks = Chunks(chat=True, model="m", want_logprobs=False, include_usage=True, token_text=str)
    out = chunks.first() + chunks.of(_reply("a", [1], False)) + chunks.of(_reply("b", [2], True))
    assert out[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [c["choices"][0]["delta"].get("content") for c in out[1:3]] == ["a", "b"]
    assert out[3]["choices"][0]["finish_reason"] == "length" and out[3]["usage"] is None
    assert out[4]["choices"] == [] and out[4]["usage"]["completion_tokens"] == 2
    assert len({c["id"] for c in out}) == 1


class EngineError(grpc.RpcError):
    """An engine's error, as its gRPC stub raises it."""

    def __init__(self, code: grpc.StatusCode, details: str, field: str | None = None) -> None:
        self._code, self._details, self._field = code, details, field

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return trailing_field(self._field)


@pytest.mark.parametrize(
    "exc, status",
    [(FieldError("sampling.temperature", "temperature must be >= 0"), 400),
     (EngineError(grpc.StatusCode.INVALID_ARGUMENT, "sampling.temperature must be a finite number >= 0",
                      "sampling.temperature"), 400),
     (TemplateNotFound("template 'x' not found"), 404),
     (TemplateExists("exists"), 409), (LimitExceeded("max_templates"), 429),
     (RequestError(grpc.StatusCode.UNAUTHENTICATED, "unknown API key"), 401),
     (RequestError(grpc.StatusCode.PERMISSION_DENIED, "scope"), 403),
     (RequestError(grpc.StatusCode.UNAVAILABLE, "no engine"), 503), (NoReplica("no engine"), 503),
     (RequestError(grpc.StatusCode.DEADLINE_EXCEEDED, "late"), 504), (RuntimeError("bug"), 500)],
)  # fmt: skip
def test_errors_get_the_status_of_their_grpc_code(exc, status):
    error = api_error(exc)
    assert error.status == status and error.body()["error"]["message"]
    if status == 400:
        assert error.param == "temperature"


@pytest.mark.parametrize(
    "field, param",
    [("sampling.max_new_tokens", "max_tokens"), ("chat.messages[2].role", "messages"), ("cache_key",
     "prompt_cache_key"), ("token_ids.ids", None), ("cache_salt", None), (None, None),
     ("sampling.logit_bias", "logit_bias"), ("logit_bias", "logit_bias"), ("sampling.min_p", "min_p"),
     ("chat.chat_template_kwargs", "chat_template_kwargs"), ("sampling.repetition_penalty", "repetition_penalty")],
)  # fmt: skip
def test_a_refused_field_is_named_as_openai_names_it(field, param):
    assert api_error(FieldError(field, "refused")).param == param


def test_a_plain_value_error_names_no_field():
    """Only an error that carries its field names one: no message is parsed for it."""
    assert api_error(ValueError("temperature must be >= 0")).param is None


def test_an_http_call_runs_its_callbacks_once_when_it_ends():
    call, ran = HttpCall(), []
    assert call.time_remaining() is None  # the client closes the connection instead
    assert call.add_callback(lambda: ran.append(1))
    call.end()
    call.end()
    assert ran == [1] and not call.is_active() and not call.add_callback(lambda: ran.append(2))


def test_the_callers_key_is_the_first_bearer_token():
    assert bearer_key(["Bearer k"]) == "k"
    assert bearer_key(["Basic dXNlcg==", "bearer  k2 "]) == "k2"
    assert bearer_key([]) is None and bearer_key(["Bearer "]) is None and bearer_key([b"Bearer k"]) is None


def test_a_cache_key_routes_to_one_replica_within_its_tenant():
    replicas = ["10.0.0.1:50052", "10.0.0.2:50052", "10.0.0.3:50052"]
    router = Router(RouterConfig(policy="affinity"))
    router.set_replicas(replicas)
    for address in replicas:
        router.set_serving(address, True)
    key = cache_key_member("acme", "conv-7")
    assert {router.choose(RouteKey(template=key)) for _ in range(5)} == {rendezvous(key.encode(), replicas)[0]}
    assert cache_key_member("globex", "conv-7") != key  # tenants' keys never meet
    assert cache_key_member("acme", "bot") != "acme/bot"  # nor a template's (':' is in no template name)


def test_the_models_sampling_defaults_fill_what_the_request_leaves_unset():
    model = epb.SamplingParams(temperature=0.7, top_p=0.8, top_k=20, min_p=0.05, repetition_penalty=1.1)
    out = generate_request(ChatCompletionRequest.model_validate({**CHAT, "top_p": 0.5}), model).sampling
    assert [round(v, 3) for v in (out.temperature, out.top_p, out.min_p, out.repetition_penalty)] == [0.7, 0.5, 0.05,
                                                                                                     1.1]  # fmt: skip
    assert out.top_k == 20 and out.max_new_tokens_to_context
    plain = generate_request(ChatCompletionRequest.model_validate({**CHAT, "max_tokens": 5})).sampling
    assert plain.temperature == 1.0 and not plain.HasField("top_p") and plain.max_new_tokens == 5
    assert not plain.max_new_tokens_to_context


def test_streamed_choices_keep_their_own_offsets_and_the_usage_waits_for_all():
    chunks = Chunks(chat=False, model="m", want_logprobs=True, include_usage=True, token_text=str, choices=2)
    out = chunks.of(_reply("ab", [1, 2], False), 1) + chunks.of(_reply("c", [3], True), 0)
    assert [c["choices"][0]["index"] for c in out] == [1, 0, 0]
    assert out[1]["choices"][0]["logprobs"]["text_offset"] == [0]  # choice 0's own offset
    assert not any(c["choices"] == [] for c in out)  # choice 1 has not finished
    last = chunks.of(_reply("", [], True), 1)
    assert last[-1]["choices"] == [] and last[-1]["usage"]["completion_tokens"] == 4


def _scored(ids: list[int], first: int, logprobs: list[float], top: bool = False) -> epb.PromptLogprobs:
    out = epb.PromptLogprobs(token_ids=ids, first_position=first, logprobs=logprobs)
    if top:
        out.top_logprobs.extend(epb.TopLogprobs(token_ids=[9], logprobs=[lp + 1]) for lp in logprobs)
    return out


def test_an_echoed_completion_puts_the_prompt_and_its_logprobs_first():
    reply = _reply("ab", [1, 2], True)
    reply.prompt_logprobs.CopyFrom(_scored([7, 8, 9], 1, [-1.0, -2.0], top=True))
    body = completion_body([reply], chat=False, model="m", want_logprobs=True, token_text=str, echoes=["789"])
    choice = body["choices"][0]
    assert choice["text"] == "789ab"
    lp = choice["logprobs"]
    assert lp["tokens"] == ["7", "8", "9", "1", "2"] and lp["token_logprobs"] == [None, -1.0, -2.0, -0.5, -0.5]
    # OpenAI's top logprobs: the most likely ones with the token itself among them.
    assert lp["top_logprobs"] == [None, {"9": 0.0, "8": -1.0}, {"9": -2.0}, {"1": -0.5}, {"2": -0.5}]
    assert lp["text_offset"] == [0, 1, 2, 3, 4]


def test_a_streamed_echo_opens_each_choice_with_its_prompt():
    plain = Chunks(chat=False, model="m", want_logprobs=False, include_usage=False, token_text=str, choices=2, forks=2)
    plain.echoes = ["Hi"]
    assert [(c["choices"][0]["index"], c["choices"][0]["text"]) for c in plain.first()] == [(0, "Hi"), (1, "Hi")]
    scored = Chunks(chat=False, model="m", want_logprobs=True, include_usage=False, token_text=str)
    scored.echoes = ["78"]
    assert scored.first() == []  # the prompt comes with its logprobs
    message = pb.GenerateResponse(prompt_logprobs=_scored([7, 8], 1, [-1.0]))
    (echo,) = scored.of(message)
    assert echo["choices"][0]["text"] == "78" and echo["choices"][0]["logprobs"]["token_logprobs"] == [None, -1.0]
    (token,) = scored.of(_reply("a", [1], False))
    assert token["choices"][0]["logprobs"]["text_offset"] == [2]


def test_prompts_sharing_a_context_follow_the_earlier_one_and_take_its_logprobs():
    context = list(range(100, 120))  # a block of 16 and 4 more
    requests = [pb.GenerateRequest(token_ids=epb.TokenIds(ids=ids)) for ids in
                (context + [1, 2], context + [3], context[:10] + [4], context + [1, 2, 5])]  # fmt: skip
    assert share_prefixes(requests, block_size=16) == {1: 0, 3: 0}
    assert [r.sampling.prompt_logprobs_from for r in requests] == [0, 20, 0, 22]  # the first position that differs
    scores = PromptScores({1: 0, 3: 0})
    leader = pb.GenerateResponse(prompt_logprobs=_scored(context + [1, 2], 1, [float(-p) for p in range(1, 22)]))
    scores.complete(0, leader)
    follower = scores.complete(1, pb.GenerateResponse(prompt_logprobs=_scored(context + [3], 20, [-50.0])))
    p = follower.prompt_logprobs
    assert p.first_position == 1 and list(p.logprobs) == [float(-q) for q in range(1, 20)] + [-50.0]
    assert list(p.token_ids) == context + [3]
