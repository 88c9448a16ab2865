"""The gateway's OpenAI-compatible HTTP API through the real ``openai`` client
(and curl), in front of a real daemon, a float64 engine and the real Redis.

One stack for the module: a gateway with API keys, a limit of two requests
at once per tenant, and its HTTP listener on a port of its own. Outputs are
compared with the gRPC API's ``Complete`` and with transformers'
``model.generate``; blocks held with the daemon's ``Stats``.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import subprocess
import tempfile

import grpc
import httpx2 as httpx
import openai
import pytest

from gateway.client import GatewayClient
from kvd_api.engine.v1 import engine_pb2 as epb
from kvd_api.gateway.v1 import gateway_pb2 as gpb
from kvd_api.gateway.v1 import gateway_pb2_grpc as pbg
from tests.conftest import (
    blocks_held,
    free_port,
    gateway_on_local_redis,
    http_stack,
    start_daemon,
    start_engine,
    wait_for,
)
from tests.integration import engine_client
from tests.integration.engine_client import reference_greedy
from tests.integration.gateway_client import document

BLOCK = 16
HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
KEYS = {"acme-key": ["generate", "templates:write"], "reader-key": ["generate"]}
SUPPORT = (
    "You are the support assistant of ACME Corp. You answer questions about ACME's products politely and "
    "briefly. ACME sells anvils, rockets, giant magnets and portable holes to customers worldwide."
)


@pytest.fixture(scope="module")
def stack(model_dir):
    """(daemon, gateway, the HTTP API's base URL, engine)."""
    folder = tempfile.mkdtemp(prefix="kvd-http-", dir="/tmp")
    with open(f"{folder}/keys.json", "w") as f:
        json.dump({"keys": [{"key": k, "tenant": "acme", "scopes": s} for k, s in KEYS.items()]}, f)
    daemon = ["--block-size", str(BLOCK), "--num-blocks", "512", "--lease-s", "2"]
    gateway = ["--api-keys", f"{folder}/keys.json", "--max-concurrent-requests", "2"]
    with http_stack(model_dir, daemon, ["--dtype", "float64"], gateway, folder, api_key="acme-key") as s:
        yield s.daemon, s.gateway, s.base_url, s.engine


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack[2], api_key="acme-key", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model_name(client):
    (model,) = client.models.list().data
    return model.id


@pytest.fixture(scope="module")
def grpc_client(stack):
    with GatewayClient(stack[1].address, api_key="acme-key", timeout_s=120) as c:
        yield c


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


# ---------------------------------------------------------------- outputs


def test_models_lists_the_served_model_with_its_context(client, model_name, grpc_client):
    info = grpc_client.info()
    model = client.models.retrieve(model_name)
    assert model.id == info.model and model.model_extra["context_length"] == info.max_context
    assert model.model_extra["max_model_len"] == info.max_context and model.owned_by == "kvd"
    assert model.model_extra["root"] == HUB_ID and model.model_extra["parent"] is None


def test_the_model_answers_to_its_hugging_face_id(client, model_name):
    """The bundled SmolLM2 by the id of its model card (a client configured from it, LiteLLM's say)."""
    assert client.models.retrieve(HUB_ID).id == HUB_ID
    by_id = client.chat.completions.create(model=HUB_ID, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                           **GREEDY)  # fmt: skip
    by_name = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "Hi"}],
                                             max_tokens=4, **GREEDY)  # fmt: skip
    assert by_id.model == HUB_ID and by_id.choices[0].message.content == by_name.choices[0].message.content


def test_chat_equals_grpc_complete_and_model_generate(client, model_name, grpc_client, tokenizer, reference_model):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
    reply = client.chat.completions.create(model=model_name, messages=messages, max_tokens=8, **GREEDY)
    grpc_reply = grpc_client.complete(chat=[(m["role"], m["content"]) for m in messages], max_new_tokens=8,
                                      ignore_eos=True)  # fmt: skip
    expected = reference_greedy(reference_model, chat_ids(tokenizer, messages), 8)
    assert list(grpc_reply.token_ids) == expected
    assert reply.choices[0].message.content == grpc_reply.text == tokenizer.decode(expected, skip_special_tokens=True)
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 8 and reply.usage.prompt_tokens == grpc_reply.usage.prompt_tokens


def test_text_completion_of_token_ids_equals_grpc_and_model_generate(client, model_name, grpc_client, tokenizer,
                                                                     reference_model):  # fmt: skip
    ids = tokenizer.encode("The capital of France is", add_special_tokens=False)
    reply = client.completions.create(model=model_name, prompt=ids, max_tokens=6, logprobs=2, **GREEDY)
    grpc_reply = grpc_client.complete(ids, max_new_tokens=6, ignore_eos=True, logprobs=True, top_logprobs=2)
    assert list(grpc_reply.token_ids) == reference_greedy(reference_model, ids, 6)
    assert reply.choices[0].text == grpc_reply.text
    logprobs = reply.choices[0].logprobs
    assert logprobs.tokens == [tokenizer.decode([t]) for t in grpc_reply.token_ids]
    assert logprobs.token_logprobs == pytest.approx(list(grpc_reply.logprobs))
    assert all(len(top) == 2 for top in logprobs.top_logprobs)


def test_streams_sync_and_async_give_the_whole_reply(client, stack, model_name):
    prompt = "Write a sentence about rivers."
    whole = client.completions.create(model=model_name, prompt=prompt, max_tokens=12, **GREEDY)
    chunks = list(client.completions.create(model=model_name, prompt=prompt, max_tokens=12, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))  # fmt: skip
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == whole.choices[0].text and len([t for t in texts if t]) > 1
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"

    async def chat_stream() -> tuple[str, str]:
        async with openai.AsyncOpenAI(base_url=stack[2], api_key="acme-key", max_retries=0) as aclient:
            messages = [{"role": "user", "content": prompt}]
            whole = await aclient.chat.completions.create(model=model_name, messages=messages, max_tokens=10,
                                                          **GREEDY)  # fmt: skip
            stream = await aclient.chat.completions.create(model=model_name, messages=messages, max_tokens=10,
                                                           stream=True, **GREEDY)  # fmt: skip
            deltas = [c.choices[0].delta.content or "" async for c in stream]
            return whole.choices[0].message.content, "".join(deltas)

    whole_text, streamed = asyncio.run(chat_stream())
    assert streamed == whole_text and whole_text


def test_curl_sees_the_chunks_as_they_come(stack, model_name):
    body = {"model": model_name, "prompt": "Count: one, two,", "max_tokens": 48, "stream": True, "ignore_eos": True}
    curl = subprocess.Popen(
        ["curl", "--silent", "--no-buffer", f"{stack[2]}/completions", "-H", "Authorization: Bearer acme-key",
         "-H", "Content-Type: application/json", "-d", json.dumps(body)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        first = curl.stdout.readline()
        assert first.startswith("data: {") and curl.poll() is None  # the first chunk came while tokens still come
        rest = curl.stdout.read()
    finally:
        curl.wait(timeout=60)
    events = [line for line in (first + rest).splitlines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) > 10


# ------------------------------------------------------------------ caching


def test_cached_tokens_count_a_template_and_a_repeated_prompt(client, model_name, tokenizer):
    created = client.post("/templates", body={"name": "support-bot", "content": SUPPORT}, cast_to=httpx.Response)
    template = created.json()
    try:
        assert template["cached_token_count"] == len(tokenizer.encode(SUPPORT)) // BLOCK * BLOCK > 0
        reply = client.completions.create(model=model_name, prompt=" Customer: hello.", max_tokens=2,
                                          extra_body={"template": "support-bot"})  # fmt: skip
        assert reply.usage.prompt_tokens_details.cached_tokens >= template["cached_token_count"]
        assert reply.usage.model_extra["kvd"]["template_tokens"] == template["token_count"]
    finally:
        client.delete("/templates/support-bot", cast_to=httpx.Response)
    long_prompt = [{"role": "user", "content": document(tokenizer, 200) + " Summarise."}]
    usages = [
        client.chat.completions.create(model=model_name, messages=long_prompt, max_tokens=1,
                                       prompt_cache_key="conversation-7").usage
        for _ in range(2)
    ]  # fmt: skip
    first, again = (u.prompt_tokens_details.cached_tokens for u in usages)
    assert first < BLOCK * 2  # at most the chat template's default system prompt, cached by earlier tests
    assert again > first and again >= (usages[1].prompt_tokens // BLOCK - 1) * BLOCK


def test_a_chat_template_takes_chat_messages(client, model_name, grpc_client):
    body = {"name": "terse", "messages": [{"role": "system", "content": "You are terse. " * 8}]}
    client.post("/templates", body=body, cast_to=httpx.Response)
    try:
        messages = [{"role": "user", "content": "Hi"}]
        reply = client.chat.completions.create(model=model_name, messages=messages, max_tokens=4, temperature=0,
                                               extra_body={"template": "terse", "ignore_eos": True})  # fmt: skip
        grpc_reply = grpc_client.complete(chat=[("user", "Hi")], template="terse", max_new_tokens=4, ignore_eos=True)
        assert reply.choices[0].message.content == grpc_reply.text
        assert reply.usage.prompt_tokens_details.cached_tokens >= BLOCK
        with pytest.raises(openai.BadRequestError, match="chat messages"):
            client.completions.create(model=model_name, prompt="Hi", extra_body={"template": "terse"})
    finally:
        client.delete("/templates/terse", cast_to=httpx.Response)


def test_template_crud_over_http(stack):
    with httpx.Client(base_url=stack[2], headers={"Authorization": "Bearer acme-key"}, timeout=120) as http:
        for name in ("crud-a", "crud-b", "crud-c"):
            assert (
                http.post("/templates", json={"name": name, "content": SUPPORT, "description": name}).status_code == 200
            )
        assert http.post("/templates", json={"name": "crud-a", "content": "x"}).status_code == 409
        names, token = [], ""
        while True:
            page = http.get("/templates", params={"page_size": 2, "page_token": token}).json()
            assert len(page["data"]) <= 2 and all(t["content"] == "" for t in page["data"])
            names += [t["name"] for t in page["data"] if t["name"].startswith("crud-")]
            token = page["next_page_token"]
            if not page["has_more"]:
                break
        assert names == ["crud-a", "crud-b", "crud-c"]
        assert http.get("/templates/crud-b").json()["content"] == SUPPORT
        updated = http.patch("/templates/crud-b", json={"ttl_seconds": 100, "description": "new"}).json()
        assert updated["description"] == "new" and updated["expires_at"] is not None
        assert http.patch("/templates/crud-b", json={"content": "x"}).status_code == 400
        for name in ("crud-a", "crud-b", "crud-c"):
            assert http.delete(f"/templates/{name}").json()["deleted"] is True
        assert http.get("/templates/crud-a").status_code == 404
        assert http.get("/templates", params={"page_token": "forged.0"}).status_code == 400


# ------------------------------------------------------------------- errors


def test_errors_raise_the_clients_classes(stack, client, model_name):
    with pytest.raises(openai.NotFoundError, match="not found"):
        client.completions.create(model=model_name, prompt="Hi", extra_body={"template": "no-such-template"})
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-4o", prompt="Hi")
    for key in ("wrong-key", ""):
        stranger = openai.OpenAI(base_url=stack[2], api_key=key or "unused", max_retries=0,
                                 default_headers={} if key else {"Authorization": ""})  # fmt: skip
        with pytest.raises(openai.AuthenticationError):
            stranger.completions.create(model=model_name, prompt="Hi")
    reader = openai.OpenAI(base_url=stack[2], api_key="reader-key", max_retries=0)
    with pytest.raises(openai.PermissionDeniedError, match="templates:write"):
        reader.post("/templates", body={"name": "mine", "content": "x"}, cast_to=httpx.Response)
    refused = {"n": 0, "tools": "get_weather", "frequency_penalty": 2.5,
               "response_format": {"type": "xml"}, "temperature": 3, "max_tokens": 0}  # fmt: skip
    for param, value in refused.items():
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "Hi"}],
                                           **{param: value})  # fmt: skip
        assert info.value.body["param"] == param, info.value.body
    ignored = client.completions.with_raw_response.create(model=model_name, prompt="Hi", max_tokens=1,
                                                          extra_body={"best_friend": 1})  # fmt: skip
    assert ignored.headers["x-kvd-ignored-fields"] == "best_friend"  # ignored, as vLLM does, and named
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "Hi"}], max_tokens=1,
                                       logit_bias={"99999999": 5})  # fmt: skip
    assert info.value.body["param"] == "logit_bias"  # the engine's check, named across the boundary
    with pytest.raises(openai.BadRequestError, match="prompt") as info:
        client.completions.create(model=model_name, prompt=[10**12])
    assert info.value.body["param"] == "prompt"  # the engine's refusal names its field across the boundary


def test_a_dropped_stream_frees_its_blocks_and_its_slot(stack, client, model_name, tokenizer):
    daemon, _, base, _ = stack
    assert wait_for(lambda: blocks_held(daemon) == 0, 15)
    body = {"model": model_name, "prompt": document(tokenizer, 100), "max_tokens": 4000, "stream": True,
            "ignore_eos": True}  # fmt: skip
    headers = {"Authorization": "Bearer acme-key"}
    with httpx.Client(base_url=base, headers=headers, timeout=120) as first, \
         httpx.Client(base_url=base, headers=headers, timeout=120) as second:  # fmt: skip
        streams = [c.stream("POST", "/completions", json=body) for c in (first, second)]
        readers = [stream.__enter__().iter_lines() for stream in streams]  # kept: a reader collected closes its stream
        for lines in readers:
            assert next(lines).startswith("data: ")
        assert blocks_held(daemon) > 0
        with pytest.raises(openai.RateLimitError, match="max_concurrent_requests"):  # the tenant's two run
            client.completions.create(model=model_name, prompt="Hi", max_tokens=1)
        for stream in streams:
            stream.__exit__(None, None, None)
    assert wait_for(lambda: blocks_held(daemon) == 0, 10), blocks_held(daemon)
    assert client.completions.create(model=model_name, prompt="Hi", max_tokens=1).usage.completion_tokens == 1
    # A whole (unstreamed) reply's client that gives up: the same.
    impatient = httpx.Client(base_url=base, headers=headers, timeout=httpx.Timeout(120, read=2))
    with impatient, pytest.raises(httpx.ReadTimeout):
        impatient.post("/completions", json={**body, "stream": False})
    assert wait_for(lambda: blocks_held(daemon) == 0, 10), blocks_held(daemon)


def test_generations_over_both_apis_count_in_one_limit(stack, model_name, workdir):
    """A gateway of --max-open-requests 1: while a gRPC stream is open, an HTTP
    completion gets 429 and a gRPC one RESOURCE_EXHAUSTED at once; the other
    routes still answer; once the stream is cancelled, HTTP is served again."""
    daemon, _, _, engine = stack
    http = f"127.0.0.1:{free_port()}"
    args = ["--max-open-requests", "1", "--http-listen", http]
    ask = {"model": model_name, "prompt": [5, 6, 7], "max_tokens": 2}
    with gateway_on_local_redis(engine.address, workdir, 1, args) as gateway, \
         grpc.insecure_channel(gateway.address) as channel:  # fmt: skip
        stub = pbg.GatewayStub(channel)
        sampling = epb.SamplingParams(max_new_tokens=400, ignore_eos=True)
        held = stub.Generate(gpb.GenerateRequest(token_ids=epb.TokenIds(ids=[5, 6, 7, 8]), sampling=sampling))
        next(held)
        refused = httpx.post(f"http://{http}/v1/completions", json=ask, timeout=10)
        assert refused.status_code == 429, refused.text
        error = refused.json()["error"]
        assert error["code"] == "resource_exhausted"
        assert error["message"].startswith("overloaded: 1 requests are open here (--max-open-requests)")
        with pytest.raises(grpc.RpcError) as grpc_refused:
            stub.Complete(gpb.GenerateRequest(text="Hi", sampling=epb.SamplingParams(max_new_tokens=1)), timeout=10)
        assert grpc_refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert httpx.get(f"http://{http}/v1/models", timeout=10).status_code == 200
        held.cancel()
        assert wait_for(lambda: httpx.post(f"http://{http}/v1/completions", json=ask, timeout=60).status_code == 200,
                        10)  # fmt: skip
    assert wait_for(lambda: blocks_held(daemon) == 0, 10), blocks_held(daemon)


def test_an_error_after_the_first_token_ends_the_stream_with_an_error_event(stack, model_name, model_dir, workdir):
    """A second engine on the module's daemon, drained with no time left while
    an HTTP stream runs on it: the stream's status (200) is sent, so the error
    comes as an event in OpenAI's shape, which the ``openai`` client raises;
    no block stays held."""
    daemon = stack[0]
    engine = start_engine(daemon, ["--model", str(model_dir), "--dtype", "float64"], workdir)
    http = f"127.0.0.1:{free_port()}"
    try:
        with gateway_on_local_redis(engine.address, workdir, 1, ["--http-listen", http]):
            client = openai.OpenAI(base_url=f"http://{http}/v1", api_key="unused", max_retries=0, timeout=120)
            stream = client.completions.create(model=model_name, prompt=[5, 6, 7], max_tokens=400, stream=True,
                                               extra_body={"ignore_eos": True})  # fmt: skip
            chunks = iter(stream)
            assert next(chunks).choices[0].text is not None  # streaming: the status is sent
            reply = engine_client.stub(engine.address).Drain(epb.DrainRequest(timeout_s=0.01), timeout=60)
            with pytest.raises(openai.APIError, match="drain ran out of time") as failed:
                for _ in chunks:
                    pass
            assert failed.value.body["code"] == "unavailable"
            assert reply.cut_short == 1
    finally:
        engine.stop()
    assert wait_for(lambda: blocks_held(daemon) == 0, 10), blocks_held(daemon)


# ------------------------------------------------------ prompts and endpoints


def test_a_list_of_prompts_equals_separate_requests(client, model_name, tokenizer):
    prompts = ["The capital of France is", "Once upon a time", "1, 2, 3,"]
    ids = tokenizer.encode(" A list of token ids")
    batch = client.completions.create(model=model_name, prompt=prompts, max_tokens=6, **GREEDY)
    alone = [client.completions.create(model=model_name, prompt=p, max_tokens=6, **GREEDY) for p in prompts]
    assert [c.index for c in batch.choices] == [0, 1, 2]
    assert [c.text for c in batch.choices] == [a.choices[0].text for a in alone]
    assert batch.usage.completion_tokens == 18
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    streamed = client.completions.create(model=model_name, prompt=[ids, ids[:3]], max_tokens=5, stream=True,
                                         **GREEDY)  # fmt: skip
    texts = ["", ""]
    for chunk in streamed:
        texts[chunk.choices[0].index] += chunk.choices[0].text
    singles = [client.completions.create(model=model_name, prompt=p, max_tokens=5, **GREEDY).choices[0].text
               for p in (ids, ids[:3])]  # fmt: skip
    assert texts == singles


def test_tokenize_and_detokenize_agree_with_the_tokenizer(stack, model_name, tokenizer):
    base = stack[2].removesuffix("/v1")
    headers = {"Authorization": "Bearer acme-key"}
    text = "The harbour master said: ahoy!"
    tokens = httpx.post(f"{base}/tokenize", json={"model": model_name, "prompt": text}, headers=headers).json()
    assert tokens["tokens"] == tokenizer.encode(text) and tokens["count"] == len(tokens["tokens"])
    messages = [{"role": "user", "content": "Hi"}]
    chat = httpx.post(f"{base}/tokenize", json={"messages": messages}, headers=headers).json()
    assert chat["tokens"] == chat_ids(tokenizer, messages) and chat["max_model_len"] > 0
    back = httpx.post(f"{base}/detokenize", json={"tokens": tokens["tokens"]}, headers=headers).json()
    assert back == {"prompt": tokenizer.decode(tokens["tokens"])}
    assert httpx.get(f"{base}/version").json()["version"]
    assert "kvd_gateway_http_requests_total" in httpx.get(f"{base}/metrics").text


def test_a_raw_sse_reader_splitting_on_blank_lines_reads_every_event(stack, model_name):
    body = {"model": model_name, "prompt": "Count: one, two,", "max_tokens": 12, "stream": True, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    with httpx.Client(base_url=stack[2], headers={"Authorization": "Bearer acme-key"}, timeout=120) as http:
        raw = http.post("/completions", json=body).content
    events = raw.split(b"\n\n")
    assert events[-1] == b"" and events[-2] == b"data: [DONE]" and b"\r" not in raw
    chunks = [json.loads(e.removeprefix(b"data: ")) for e in events[:-2]]
    assert all(e.startswith(b"data: {") for e in events[:-2])  # no comment (ping) lines
    assert sum(len(c["choices"][0]["text"]) > 0 for c in chunks) > 1 and "usage" not in chunks[-1]


# -------------------------------------- a small cache, a strict chat template


#: SmolLM2's chat template, made to refuse roles that do not alternate (as many models' templates do).
STRICT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'user' and loop.index0 > 0 and "
    "messages[loop.index0 - 1]['role'] == 'user' %}{{ raise_exception('Conversation roles must alternate "
    "user/assistant/user/assistant/...') }}{% endif %}{{ '<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SMALL_BLOCKS = 8  # 128 tokens: a chat run to the end of what the cache holds ends fast


@pytest.fixture(scope="module")
def small_stack(model_dir):
    """(an openai client, its names) on a gateway named ``--served-model-name org/strict,strict``, over
    an engine whose model is SmolLM2 with the strict chat template, on a daemon of 8 blocks."""
    folder = tempfile.mkdtemp(prefix="kvd-http-small-", dir="/tmp")
    strict = os.path.join(folder, "strict-smollm2")
    os.makedirs(strict)
    for entry in os.listdir(model_dir):
        if entry != "chat_template.jinja":
            os.symlink(os.path.join(model_dir, entry), os.path.join(strict, entry))
    with open(os.path.join(strict, "chat_template.jinja"), "w") as f:
        f.write(STRICT_TEMPLATE)
    http = f"127.0.0.1:{free_port()}"
    daemon = start_daemon(["--block-size", str(BLOCK), "--num-blocks", str(SMALL_BLOCKS)], folder)
    engine = start_engine(daemon, ["--model", strict, "--dtype", "float32"], folder)
    args = ["--http-listen", http, "--served-model-name", "org/strict,strict"]
    try:
        with gateway_on_local_redis(engine.address, folder, 1, args):
            assert wait_for(lambda: httpx.get(f"http://{http}/ready").status_code == 200, 30)
            yield openai.OpenAI(base_url=f"http://{http}/v1", api_key="unused", max_retries=0, timeout=120)
    finally:
        engine.stop()
        daemon.stop()
        shutil.rmtree(folder, ignore_errors=True)


def test_a_chat_without_max_tokens_runs_to_what_the_cache_holds(small_stack):
    """No max_tokens: past the old 64-token cut, to the end of what the cache holds (8 blocks of 16 tokens,
    less the engine's one speculative slot), ending with finish_reason "length"."""
    reply = small_stack.chat.completions.create(model="strict", messages=[{"role": "user", "content": "Tell a story."}],
                                                temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens > 64
    assert reply.usage.prompt_tokens + reply.usage.completion_tokens == SMALL_BLOCKS * BLOCK - 1
    with pytest.raises(openai.BadRequestError):  # a stated max_tokens that cannot fit stays a 400
        small_stack.chat.completions.create(model="strict", messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=SMALL_BLOCKS * BLOCK)  # fmt: skip


def test_a_chat_template_error_is_a_bad_request_naming_messages(small_stack):
    messages = [{"role": "user", "content": "Hi"}, {"role": "user", "content": "Hello?"}]
    with pytest.raises(openai.BadRequestError, match="roles must alternate") as info:
        small_stack.chat.completions.create(model="strict", messages=messages, max_tokens=2)
    assert info.value.body["param"] == "messages"


def test_served_model_names_replace_the_folders_name(small_stack):
    assert [m.id for m in small_stack.models.list().data] == ["org/strict"]
    reply = small_stack.chat.completions.create(model="org/strict", messages=[{"role": "user", "content": "Hi"}],
                                                max_tokens=2)  # fmt: skip
    assert reply.model == "org/strict" and reply.usage.completion_tokens == 2
    with pytest.raises(openai.NotFoundError):
        small_stack.chat.completions.create(model="strict-smollm2", messages=[{"role": "user", "content": "Hi"}])


def test_n_choices_are_forks_of_one_prefill(stack, client, model_name, tokenizer):
    """n = 4 on a fresh 100-token prompt computes it once: the forks find its
    6 full blocks and recompute only its last 4 tokens. Greedy forks are
    identical; seeded sampled forks differ and repeat with the seed."""
    daemon = stack[0]
    rng = random.Random(34)
    prompt = [rng.randrange(100, 40000) for _ in range(100)]  # no other test's blocks

    def computed_prompt_tokens(**kwargs):
        with daemon.client() as c:
            before = c.stats()
        reply = client.completions.create(model=model_name, prompt=prompt, n=4, max_tokens=6,
                                          extra_body={"ignore_eos": True}, **kwargs)  # fmt: skip
        with daemon.client() as c:
            after = c.stats()
        return reply, (after.query_tokens - before.query_tokens) - (after.hit_tokens - before.hit_tokens)

    greedy, computed = computed_prompt_tokens(temperature=0)
    assert [c.index for c in greedy.choices] == [0, 1, 2, 3]
    assert len({c.text for c in greedy.choices}) == 1
    assert computed == 100 + 3 * 4, computed
    assert greedy.usage.prompt_tokens == 100 and greedy.usage.completion_tokens == 24
    sampled, _ = computed_prompt_tokens(temperature=1, seed=5)
    again, _ = computed_prompt_tokens(temperature=1, seed=5)
    assert len({c.text for c in sampled.choices}) > 1
    assert [c.text for c in sampled.choices] == [c.text for c in again.choices]
