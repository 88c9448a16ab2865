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

from gateway.http_api.app import create_app
from gateway.http_api.threads import WorkerThreads
from gateway.request_errors import RequestError
from gateway.templates import Template, TemplateExists, TemplateNotFound, TemplatePage
from gateway.tenants import SCOPES, Authenticator, Principal, key_digest
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

    def authorize(self, key, scope):
        return self.auth.authorize(key, scope)

    def model_info(self) -> epb.InfoResponse:
        return epb.InfoResponse(model="m", max_context=2048, block_size=16)

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
    """The SSE stream's data, JSON decoded but for ``[DONE]``."""
    lines = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
    return [line if line == "[DONE]" else json.loads(line) for line in lines]


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
    [("n", 2, "n"), ("tools", [{"type": "function"}], "tools"), ("unknown_field", 1, "unknown_field"),
     ("temperature", 3, "temperature"), ("stream_options", {"include_usage": True}, "stream_options")],
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
    assert send("GET", "/v1/models/m", headers=AUTH).json()["max_model_len"] == 2048
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
