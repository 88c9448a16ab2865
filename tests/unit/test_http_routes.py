"""The HTTP API's routes (gateway/http_api) in front of a small fake request
path: statuses, OpenAI's error JSON with ``param``, the SSE stream's events,
the open-generation count and the end of each call, through the ASGI app
itself (no socket, no engine)."""

from __future__ import annotations

import asyncio
import json
import threading

import grpc
import httpx2 as httpx
import pytest

import kvd
from gateway.http_api.app import create_app
from gateway.http_api.threads import WorkerThreads
from gateway.request_errors import RequestError
from gateway.templates import Template, TemplateExists, TemplateNotFound, TemplatePage
from gateway.tenants import SCOPES, Authenticator, Principal, key_digest
from kvd.common.chat import generation_prompt
from kvd.common.field_error import FieldError
from kvd.common.grpc_server import OpenCalls
from kvd_api.engine.v1 import engine_pb2 as epb
from kvd_api.gateway.v1 import gateway_pb2 as pb

KEYS = {"good": Principal("acme", SCOPES), "reader": Principal("acme", frozenset())}
AUTH = {"authorization": "Bearer good"}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


class Keys:
    def lookup(self, digest: str) -> Principal | None:
        return {key_digest(k): p for k, p in KEYS.items()}.get(digest)


def reply(text: str, token: int, last: bool = False) -> pb.GenerateResponse:
    out = pb.GenerateResponse(text=text, token_ids=[token], logprobs=[-0.5])
    if last:
        out.finish_reason = epb.FINISH_REASON_LENGTH
        out.usage.CopyFrom(pb.Usage(prompt_tokens=3, completion_tokens=2, cached_prompt_tokens=1))
    return out


class FakeRequestPath:
    """What the routes call of ``RequestPath``: a real key check, scripted
    replies (``script``: messages, or an exception, in order), templates in a dict."""

    def __init__(self) -> None:
        self.auth = Authenticator(Keys())
        self.script: list = [reply("a", 1), reply("b", 2, last=True)]
        self.requests: list[tuple[str, pb.GenerateRequest]] = []
        self.calls_ended = threading.Event()
        self.templates: dict[str, Template] = {}
        self.replicas = ["10.0.0.1:50052"]
        self.default_sampling = epb.SamplingParams()

    def authorize(self, key, scope):
        return self.auth.authorize(key, scope)

    def model_info(self) -> epb.InfoResponse:
        return epb.InfoResponse(model="m", max_context=2048, block_size=16, default_sampling=self.default_sampling)

    def free_slots(self, tenant):
        return None

    def tokenize_text(self, text, add_special_tokens=True):
        return [1] * add_special_tokens + [ord(c) for c in text]  # 1: a BOS

    def tokenize_chat(self, chat):
        if chat.messages[-1].role == "system":
            raise FieldError("chat.messages", "chat.messages: the model's chat template refused them: roles")
        return [ord(m.content[0]) for m in chat.messages] + [9] * generation_prompt(chat)

    def detokenize(self, token_ids):
        return "".join(chr(t) for t in token_ids)

    def serving(self):
        return self.replicas

    def token_text(self, token_id: int) -> str:
        return f"<{token_id}>"

    def generate(self, tenant, request, call):
        self.requests.append((tenant, request))
        call.add_callback(self.calls_ended.set)
        for step in self.script:
            if isinstance(step, Exception):
                raise step
            yield step

    def complete(self, tenant, request, call):
        whole = pb.GenerateResponse()
        for message in self.generate(tenant, request, call):
            whole.text += message.text
            whole.token_ids.extend(message.token_ids)
            if message.HasField("usage"):
                whole.finish_reason = message.finish_reason
                whole.usage.CopyFrom(message.usage)
        return whole

    def create_template(self, tenant, new):
        if new.name in self.templates:
            raise TemplateExists(f"template {new.name!r} already exists")
        template = Template(tenant, new.name, new.content, [1] * 20, new.description, 1700000000.75, None, 16,
                            new.messages)  # fmt: skip
        self.templates[new.name] = template
        return template

    def get_template(self, tenant, name):
        if name not in self.templates:
            raise TemplateNotFound(f"template {name!r} not found")
        return self.templates[name]

    def list_templates(self, tenant, page_size, page_token):
        if page_size < 0:
            raise FieldError("page_size", f"page_size must be >= 0, got {page_size}")
        return TemplatePage(sorted(self.templates.values(), key=lambda t: t.name), "")

    def update_template(self, tenant, name, ttl_seconds, description):
        raise AssertionError("not called here")

    def delete_template(self, tenant, name):
        self.get_template(tenant, name)
        del self.templates[name]


@pytest.fixture
def path() -> FakeRequestPath:
    return FakeRequestPath()


@pytest.fixture
def open_calls() -> OpenCalls:
    return OpenCalls(4, "--max-open-requests")


@pytest.fixture
def send(path, open_calls):
    """``send(method, url, **kwargs)`` -> the response, through the ASGI app."""
    threads = WorkerThreads(4)
    app = create_app(path, threads, open_calls)

    async def go(method: str, url: str, **kwargs) -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
            return await client.request(method, url, **kwargs)

    yield lambda method, url, **kwargs: asyncio.run(go(method, url, **kwargs))
    threads.close()


def events(response: httpx.Response) -> list:
    """The SSE stream's data, JSON decoded but for ``[DONE]``, read as the
    strictest readers do: events split on ``\n\n``, each one ``data: ...`` line."""
    raw = response.content
    assert raw.endswith(b"\n\n") and b"\r" not in raw, raw[-200:]
    out = []
    for event in raw.split(b"\n\n")[:-1]:
        assert event.startswith(b"data: ") and b"\n" not in event, event  # no comments (pings), one line each
        data = event.removeprefix(b"data: ").decode()
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_a_chat_completion_is_the_request_paths_reply_in_openais_shape(send, path, open_calls):
    response = send("POST", "/v1/chat/completions", json=CHAT, headers=AUTH)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "chat.completion" and body["model"] == "m"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "ab"}
    assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["total_tokens"] == 5
    tenant, request = path.requests[0]
    assert tenant == "acme" and request.chat.messages[0].content == "Hi" and request.sampling.max_new_tokens == 2
    assert path.calls_ended.is_set() and open_calls.try_open()  # the call ended; its place is free again


def test_a_stream_sends_the_role_the_chunks_the_finish_and_done(send):
    body = {"model": "m", "prompt": "Hi", "stream": True, "stream_options": {"include_usage": True}}
    response = send("POST", "/v1/completions", json=body, headers=AUTH)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    sent = events(response)
    assert [e["choices"][0]["text"] for e in sent[:2]] == ["a", "b"]
    assert sent[2]["choices"][0]["finish_reason"] == "length" and sent[3]["usage"]["completion_tokens"] == 2
    assert sent[4] == "[DONE]" and len(sent) == 5


def test_a_refusal_before_the_first_token_is_a_status_naming_openais_param(send, path):
    path.script = [FieldError("sampling.max_new_tokens", "sampling.max_new_tokens must be >= 1, got 0")]
    for stream in (False, True):
        response = send("POST", "/v1/chat/completions", json={**CHAT, "stream": stream}, headers=AUTH)
        assert response.status_code == 400
        assert response.json() == {"error": {"message": "sampling.max_new_tokens must be >= 1, got 0",
                                             "type": "invalid_request_error", "param": "max_tokens",
                                             "code": "invalid_argument"}}  # fmt: skip


def test_an_error_after_the_first_token_ends_the_stream_with_an_error_event(send, path):
    path.script = [reply("a", 1), RequestError(grpc.StatusCode.UNAVAILABLE, "the engine at x is unavailable: gone")]
    response = send("POST", "/v1/chat/completions", json={**CHAT, "stream": True}, headers=AUTH)
    assert response.status_code == 200
    sent = events(response)
    assert sent[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert sent[1]["choices"][0]["delta"] == {"content": "a"}
    assert sent[2]["error"] == {"message": "the engine at x is unavailable: gone", "type": "service_unavailable_error",
                                "param": None, "code": "unavailable"}  # fmt: skip
    assert sent[3] == "[DONE]"


@pytest.mark.parametrize(
    "headers, status, kind",
    [({}, 401, "authentication_error"), ({"authorization": "Bearer nope"}, 401, "authentication_error"),
     ({"authorization": "Bearer reader"}, 403, "permission_error")],
)  # fmt: skip
def test_a_key_without_the_scope_is_refused(send, headers, status, kind):
    response = send("POST", "/v1/chat/completions", json=CHAT, headers=headers)
    assert response.status_code == status and response.json()["error"]["type"] == kind


def test_another_model_is_not_found_but_only_for_a_good_key(send):
    other = {**CHAT, "model": "gpt-4"}
    assert send("POST", "/v1/chat/completions", json=other).status_code == 401
    response = send("POST", "/v1/chat/completions", json=other, headers=AUTH)
    assert response.status_code == 404
    assert response.json()["error"]["param"] == "model" and response.json()["error"]["code"] == "model_not_found"


def test_past_the_open_generations_limit_a_request_is_429_at_once(send, path, open_calls):
    while open_calls.try_open():
        pass
    response = send("POST", "/v1/chat/completions", json=CHAT, headers=AUTH)
    assert response.status_code == 429 and response.json()["error"]["code"] == "resource_exhausted"
    assert path.requests == []


@pytest.mark.parametrize(
    "field, value, param",
    [("n", 0, "n"), ("tools", [{"type": "function"}], "tools.0.function"), ("echo", True, "echo"),
     ("temperature", 3, "temperature"), ("stream_options", {"include_usage": True}, "stream_options"),
     ("response_format", {"type": "xml"}, "response_format"), ("logit_bias", {"x": 1}, "logit_bias"),
     ("messages", [{"role": "tool", "content": "42"}], "messages"), ("guided_regex", 5, "guided_regex"),
     ("tool_choice", {"type": "function", "function": {"name": ""}}, "tool_choice"),
     ("messages", [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "messages")],
)  # fmt: skip
def test_a_body_kvd_does_not_take_is_400_naming_the_field(send, field, value, param):
    response = send("POST", "/v1/chat/completions", json={**CHAT, field: value}, headers=AUTH)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param and error["code"] == "invalid_argument" and error["message"].startswith(param)


def test_an_empty_prompt_is_400_naming_it(send):
    response = send("POST", "/v1/completions", json={"model": "m", "prompt": []}, headers=AUTH)
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"


def test_models_lists_the_served_model(send):
    listed = send("GET", "/v1/models", headers=AUTH).json()
    assert [m["id"] for m in listed["data"]] == ["m"] and listed["data"][0]["context_length"] == 2048
    card = send("GET", "/v1/models/m", headers=AUTH).json()
    assert (card["max_model_len"], card["root"], card["parent"], card["owned_by"]) == (2048, "m", None, "kvd")
    assert send("GET", "/v1/models/other", headers=AUTH).status_code == 404
    assert send("GET", "/v1/models").status_code == 401


def test_templates_over_http(send, path):
    created = send("POST", "/v1/templates", json={"name": "bot", "messages": [{"role": "system", "content": "Hi"}]},
                   headers=AUTH)  # fmt: skip
    assert created.status_code == 200
    assert created.json() == {"object": "template", "id": "bot", "name": "bot", "description": "", "token_count": 20,
                              "cached_token_count": 16, "created_at": 1700000000, "expires_at": None, "content": "",
                              "messages": [{"role": "system", "content": "Hi"}]}  # fmt: skip
    assert send("POST", "/v1/templates", json={"name": "bot", "content": "x"}, headers=AUTH).status_code == 409
    assert send("POST", "/v1/templates", json={"name": "x"}, headers={"authorization": "Bearer reader"}).status_code \
        == 403  # fmt: skip

    listed = send("GET", "/v1/templates", headers=AUTH).json()
    assert listed["has_more"] is False and listed["data"][0]["messages"] == []  # a listing carries no content
    bad_page = send("GET", "/v1/templates", params={"page_size": -1}, headers=AUTH).json()["error"]
    assert bad_page["param"] == "page_size"

    assert send("DELETE", "/v1/templates/bot", headers=AUTH).json()["deleted"] is True
    gone = send("GET", "/v1/templates/bot", headers=AUTH)
    assert gone.status_code == 404 and gone.json()["error"]["type"] == "not_found_error"


def test_ready_says_whether_a_replica_serves(send, path):
    assert send("GET", "/ready").json() == {"status": "ready", "replicas": 1}
    path.replicas = []
    assert send("GET", "/ready").status_code == 503
    assert send("GET", "/health").json() == {"status": "ok"}


def test_a_bug_is_a_500_that_says_where_to_look(send, path):
    path.script = [RuntimeError("bug")]
    response = send("POST", "/v1/chat/completions", json=CHAT, headers=AUTH)
    assert response.status_code == 500 and response.json()["error"]["code"] == "internal"


# ------------------------------------------------- defaults, fields, prompts


def test_a_chat_without_max_tokens_runs_to_the_context_and_samples_as_openai(send, path):
    body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}
    assert send("POST", "/v1/chat/completions", json=body, headers=AUTH).status_code == 200
    sampling = path.requests[-1][1].sampling
    assert sampling.max_new_tokens_to_context and not sampling.HasField("max_new_tokens")
    assert sampling.temperature == 1.0 and not sampling.HasField("top_p")  # OpenAI's: not greedy
    path.default_sampling = epb.SamplingParams(temperature=0.6, top_p=0.9, top_k=20)  # the model's generation_config
    send("POST", "/v1/completions", json={"model": "m", "prompt": "Hi", "top_k": 5}, headers=AUTH)
    sampling = path.requests[-1][1].sampling
    assert sampling.max_new_tokens == 16 and not sampling.max_new_tokens_to_context  # completions: vLLM's 16
    assert (round(sampling.temperature, 3), round(sampling.top_p, 3), sampling.top_k) == (0.6, 0.9, 5)
    send("POST", "/v1/completions", json={"model": "m", "prompt": "Hi", "temperature": 0}, headers=AUTH)
    assert path.requests[-1][1].sampling.temperature == 0  # greedy when asked


def test_the_sampling_fields_reach_the_gateways_request(send, path):
    body = {**CHAT, "top_k": -1, "min_p": 0.1, "seed": -2, "presence_penalty": 0.5, "frequency_penalty": -0.5,
            "repetition_penalty": 1.2, "logit_bias": {"42": -100, "7": 5.5}, "min_tokens": 3, "ignore_eos": True,
            "stop": ["x"], "stop_token_ids": [2], "include_stop_str_in_output": True}  # fmt: skip
    assert send("POST", "/v1/chat/completions", json=body, headers=AUTH).status_code == 200
    s = path.requests[-1][1].sampling
    assert (s.top_k, round(s.min_p, 3), s.seed, s.presence_penalty, s.frequency_penalty) == (0, 0.1, 2**64 - 2,
                                                                                            0.5, -0.5)  # fmt: skip
    assert round(s.repetition_penalty, 3) == 1.2 and dict(s.logit_bias) == {42: -100, 7: 5.5}
    assert (s.min_tokens, s.ignore_eos, list(s.stop), list(s.stop_token_ids)) == (3, True, ["x"], [2])
    assert s.include_stop_str_in_output


def test_null_fields_no_ops_and_an_echoed_assistant_message_are_accepted(send, path):
    echoed = {"role": "assistant", "content": None, "tool_calls": None, "function_call": None, "refusal": None,
              "audio": None, "annotations": []}  # fmt: skip
    body = {"model": "m", "max_tokens": 2, "temperature": None, "top_p": None, "stream": None, "logprobs": None,
            "n": 1, "best_of": 1, "user": "u-1", "safety_identifier": "s", "prompt_cache_retention": "24h",
            "parallel_tool_calls": True, "skip_special_tokens": True, "spaces_between_special_tokens": True,
            "store": True, "metadata": {"a": "b"}, "tools": None, "tool_choice": "none",
            "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                          "name": "alice"}, echoed, {"role": "user", "content": "Go on"}]}  # fmt: skip
    response = send("POST", "/v1/chat/completions", json=body, headers=AUTH)
    assert response.status_code == 200, response.text
    assert "x-kvd-ignored-fields" not in response.headers
    messages = path.requests[-1][1].chat.messages
    assert [(m.role, m.content, m.name) for m in messages] == [("user", "a\nb", "alice"), ("assistant", "", ""),
                                                               ("user", "Go on", "")]  # fmt: skip


def test_unknown_fields_are_ignored_and_named_in_a_header(send, path):
    body = {**CHAT, "best_friend": 1, "messages": [{"role": "user", "content": "Hi", "weight": 1}],
            "stream": True, "stream_options": {"include_usage": False, "continuous_usage_stats": True}}  # fmt: skip
    response = send("POST", "/v1/chat/completions", json=body, headers=AUTH)
    assert response.status_code == 200
    assert response.headers["x-kvd-ignored-fields"] == (
        "best_friend, messages[].weight, stream_options.continuous_usage_stats"
    )
    assert [e for e in events(response) if e != "[DONE]" and "usage" in e] == []  # no usage chunk unasked


def test_chat_template_fields_reach_the_chat_prompt(send, path):
    body = {**CHAT, "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}],
            "continue_final_message": True, "add_generation_prompt": False,
            "chat_template_kwargs": {"enable_thinking": False}}  # fmt: skip
    assert send("POST", "/v1/chat/completions", json=body, headers=AUTH).status_code == 200
    chat = path.requests[-1][1].chat
    assert chat.continue_final_message and chat.HasField("add_generation_prompt") and not chat.add_generation_prompt
    assert dict(chat.chat_template_kwargs) == {"enable_thinking": False}
    both = {**body, "add_generation_prompt": True}
    assert send("POST", "/v1/chat/completions", json=both, headers=AUTH).json()["error"]["param"] == (
        "continue_final_message"
    )


def test_a_list_of_prompts_is_one_choice_each_in_order_with_the_usage_summed(send, path):
    body = {"model": "m", "prompt": ["one", "two", "three"], "max_tokens": 2}
    reply = send("POST", "/v1/completions", json=body, headers=AUTH).json()
    assert [c["index"] for c in reply["choices"]] == [0, 1, 2] and all(c["text"] == "ab" for c in reply["choices"])
    assert reply["usage"]["completion_tokens"] == 6 and reply["usage"]["prompt_tokens"] == 9
    assert sorted(r.text for _, r in path.requests[-3:]) == ["one", "three", "two"]
    ids = send("POST", "/v1/completions", json={**body, "prompt": [[5, 6], [7]]}, headers=AUTH).json()
    assert len(ids["choices"]) == 2
    streamed = send("POST", "/v1/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}},
                    headers=AUTH)  # fmt: skip
    sent = events(streamed)
    texts = {i: "".join(e["choices"][0]["text"] for e in sent[:-2] if e["choices"][0]["index"] == i) for i in range(3)}
    assert texts == {0: "ab", 1: "ab", 2: "ab"}
    finishes = [e["choices"][0]["index"] for e in sent[:-2] if e["choices"][0]["finish_reason"]]
    assert sorted(finishes) == [0, 1, 2]
    assert sent[-2]["choices"] == [] and sent[-2]["usage"]["completion_tokens"] == 6 and sent[-1] == "[DONE]"


def test_n_choices_per_prompt_are_forks_started_after_their_leaders_first_message(send, path):
    started: list[tuple[str, int]] = []  # (prompt, seed) as each generation starts
    generate = path.generate

    def recorded(tenant, request, call):
        started.append((request.text, request.sampling.seed))
        yield from generate(tenant, request, call)

    path.generate = recorded
    body = {"model": "m", "prompt": ["one", "two"], "n": 3, "seed": 7, "max_tokens": 2}
    reply = send("POST", "/v1/completions", json=body, headers=AUTH).json()
    assert [c["index"] for c in reply["choices"]] == list(range(6))
    # completion tokens of every choice; the prompt's counts once per prompt (as OpenAI counts n)
    assert reply["usage"]["completion_tokens"] == 12 and reply["usage"]["prompt_tokens"] == 6
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == 2
    assert sorted(started) == sorted((p, 7 + i) for p in ("one", "two") for i in range(3))
    for prompt in ("one", "two"):  # each prompt's leader (seed 7) starts before its forks
        assert [seed for text, seed in started if text == prompt][0] == 7
    chat = send("POST", "/v1/chat/completions", json={**CHAT, "n": 2, "stream": True}, headers=AUTH)
    sent = events(chat)
    roles = [e["choices"][0]["index"] for e in sent[:-1] if e["choices"][0]["delta"].get("role")]
    finishes = [e["choices"][0]["index"] for e in sent[:-1] if e["choices"][0]["finish_reason"]]
    assert roles == [0, 1] and sorted(finishes) == [0, 1]
    too_many = send("POST", "/v1/completions", json={**body, "n": 1000}, headers=AUTH)
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "n"


def test_a_failing_prompt_of_a_list_fails_the_request(send, path):
    path.script = [FieldError("prompt", "prompt: too long")]
    response = send("POST", "/v1/completions", json={"model": "m", "prompt": ["a", "b"]}, headers=AUTH)
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"
    assert path.calls_ended.is_set()


def test_a_text_prompt_without_special_tokens_is_sent_as_token_ids(send, path):
    body = {"model": "m", "prompt": "Hi", "add_special_tokens": False}
    assert send("POST", "/v1/completions", json=body, headers=AUTH).status_code == 200
    assert list(path.requests[-1][1].token_ids.ids) == [ord("H"), ord("i")]


def test_the_model_answers_to_each_served_name(path, open_calls):
    threads = WorkerThreads(2)
    app = create_app(path, threads, open_calls, served_model_names=("org/model", "alias"))

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as client:
            listed = (await client.get("/v1/models", headers=AUTH)).json()
            by_alias = await client.post("/v1/chat/completions", json={**CHAT, "model": "alias"}, headers=AUTH)
            by_folder = await client.post("/v1/chat/completions", json=CHAT, headers=AUTH)
            unnamed = await client.post("/v1/chat/completions", json={k: v for k, v in CHAT.items() if k != "model"},
                                        headers=AUTH)  # fmt: skip
            return listed, by_alias, by_folder, unnamed

    try:
        listed, by_alias, by_folder, unnamed = asyncio.run(go())
    finally:
        threads.close()
    assert [m["id"] for m in listed["data"]] == ["org/model"]
    assert by_alias.status_code == 200 and by_alias.json()["model"] == "alias"
    assert by_folder.status_code == 404 and unnamed.json()["model"] == "org/model"


# ---------------------------------------------------------------- endpoints


def test_tokenize_and_detokenize_take_vllms_shapes(send):
    text = send("POST", "/tokenize", json={"prompt": "Hi", "model": "m"}, headers=AUTH).json()
    assert text == {"count": 3, "max_model_len": 2048, "tokens": [1, 72, 105], "token_strs": None}
    plain = send("POST", "/tokenize", json={"prompt": "Hi", "add_special_tokens": False}, headers=AUTH).json()
    assert plain["tokens"] == [72, 105]
    chat = send("POST", "/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}, headers=AUTH).json()
    assert chat["tokens"] == [72, 9] and chat["count"] == 2
    refused = send("POST", "/tokenize", json={"messages": [{"role": "system", "content": "x"}]}, headers=AUTH)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "messages"
    assert send("POST", "/tokenize", json={"prompt": "Hi"}).status_code == 401
    assert send("POST", "/tokenize", json={"prompt": "Hi", "model": "x"}, headers=AUTH).status_code == 404
    assert send("POST", "/tokenize", json={}, headers=AUTH).status_code == 400
    assert send("POST", "/detokenize", json={"tokens": [72, 105]}, headers=AUTH).json() == {"prompt": "Hi"}
    assert send("POST", "/detokenize", json={"tokens": [72]}, headers={"authorization": "Bearer reader"}).status_code \
        == 403  # fmt: skip


def test_version_and_metrics_are_open(send):
    assert send("GET", "/version").json() == {"version": kvd.__version__}
    send("POST", "/v1/chat/completions", json=CHAT, headers=AUTH)
    metrics = send("GET", "/metrics")
    assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain")
    assert 'kvd_gateway_http_requests_total{method="POST",route="/v1/chat/completions",status="200"} 1.0' in (
        metrics.text
    )
