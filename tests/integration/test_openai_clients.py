"""The gateway's HTTP API through the clients people already point at an
OpenAI-compatible server, each called as its users call it: LangChain's
``ChatOpenAI`` (no ``max_tokens``; streamed with ``stop``) and ``OpenAI``
(``batch``), LiteLLM's OpenAI-compatible provider naming the model by its
Hugging Face id, a raw reader that splits the event stream on blank lines only
(as ``vllm bench serve`` does), and the ``openai`` client sending vLLM's
sampling extras and the fields clients send as a matter of course.

One stack for the module: a daemon, a float64 engine on the real SmolLM2 and a
gateway without API keys on the real Redis, serving the model under its
Hugging Face id too. Nothing leaves 127.0.0.1: LiteLLM reads its bundled
model cost map and LangChain traces nothing.
"""

from __future__ import annotations

import json

import httpx2 as httpx
import openai
import pytest

from tests.conftest import http_stack

HF_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
# The header in which the gateway names the request's fields it ignored (docs/gateway.md).
IGNORED_FIELDS_HEADER = "x-kvd-ignored-fields"
API_KEY = "unused"  # the gateway checks no keys; every client insists on one
# A question whose greedy answer with the real SmolLM2 ends by EOS after 119 tokens.
LONG_ANSWER_QUESTION = "What is photosynthesis?"
# A question whose greedy answer's first line is a short heading.
LIST_QUESTION = "List the planets of the solar system, one per line."


@pytest.fixture(scope="module")
def stack(model_dir):
    """The HTTP API's base URL, once the gateway serves."""
    # 128 blocks of 16: 2048 tokens, room for the unbounded answer and a small cache.
    daemon = ["--block-size", "16", "--num-blocks", "128", "--lease-s", "2"]
    # The Hugging Face id first (what /v1/models lists), the folder's name as an alias.
    gateway = ["--served-model-name", f"{HF_ID},{model_dir.name}"]
    with http_stack(model_dir, daemon, ["--dtype", "float64"], gateway) as stack:
        yield stack.base_url


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack, api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def served_name(client):
    """The name ``/v1/models`` lists: what a user copies into a client's settings."""
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def langchain_openai():
    with pytest.MonkeyPatch.context() as patch:
        for variable in ("LANGSMITH_TRACING", "LANGCHAIN_TRACING_V2", "LANGCHAIN_TRACING"):
            patch.setenv(variable, "false")
        import langchain_openai

        yield langchain_openai


@pytest.fixture(scope="module")
def litellm():
    with pytest.MonkeyPatch.context() as patch:
        # NOTE: read as litellm is imported (and on a reload of its cost map):
        # without it, litellm downloads its model cost map.
        patch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
        import litellm

        litellm.telemetry = False
        litellm.suppress_debug_info = True
        litellm.callbacks, litellm.success_callback, litellm.failure_callback = [], [], []
        yield litellm


# ------------------------------------------------------------------ LangChain


def test_langchain_chat_without_max_tokens_is_not_cut_short(stack, served_name, langchain_openai):
    chat = langchain_openai.ChatOpenAI(base_url=stack, api_key=API_KEY, model=served_name, temperature=0,
                                       max_retries=0, timeout=300)  # fmt: skip
    answer = chat.invoke(LONG_ANSWER_QUESTION)
    assert answer.response_metadata["finish_reason"] == "stop", answer.response_metadata
    assert answer.usage_metadata["output_tokens"] > 64, answer.usage_metadata
    assert answer.content.strip()


def test_langchain_chat_stream_with_stop_joins_to_the_whole_answer(stack, served_name, langchain_openai):
    # NOTE: max_tokens only so that an ignored stop string fails the test in seconds, not minutes.
    chat = langchain_openai.ChatOpenAI(base_url=stack, api_key=API_KEY, model=served_name, temperature=0,
                                       max_tokens=48, max_retries=0, timeout=120)  # fmt: skip
    whole = chat.invoke(LIST_QUESTION, stop=["\n"])
    assert whole.response_metadata["finish_reason"] == "stop" and whole.content, whole.response_metadata
    streaming = langchain_openai.ChatOpenAI(base_url=stack, api_key=API_KEY, model=served_name, temperature=0,
                                            max_tokens=48, streaming=True, max_retries=0, timeout=120)  # fmt: skip
    pieces = [chunk.content for chunk in streaming.stream(LIST_QUESTION, stop=["\n"])]
    assert "".join(pieces) == whole.content and "\n" not in whole.content
    assert len([piece for piece in pieces if piece]) > 1  # streamed, not one piece at the end


def test_langchain_completions_batch_sends_one_request_and_equals_single_prompts(stack, served_name, client,
                                                                                  langchain_openai):  # fmt: skip
    prompts = ["The capital of France is", "Water boils at", "The largest planet is"]
    sent: list[dict] = []

    def record(request: httpx.Request) -> None:
        sent.append({"path": request.url.path, "body": json.loads(request.content)})

    with httpx.Client(timeout=120, event_hooks={"request": [record]}) as recording:
        llm = langchain_openai.OpenAI(base_url=stack, api_key=API_KEY, model=served_name, temperature=0,
                                      max_tokens=8, max_retries=0, http_client=recording)  # fmt: skip
        texts = llm.batch(prompts)
    assert [(s["path"], s["body"]["prompt"]) for s in sent] == [("/v1/completions", prompts)]
    singles = [
        client.completions.create(model=served_name, prompt=p, max_tokens=8, temperature=0).choices[0].text
        for p in prompts
    ]
    assert texts == singles and all(singles)


# -------------------------------------------------------------------- LiteLLM


def test_litellm_names_the_model_by_its_hugging_face_id(stack, client, model_dir, litellm):
    messages = [{"role": "user", "content": "Name a colour."}]
    reply = litellm.completion(model=f"openai/{HF_ID}", api_base=stack, api_key=API_KEY, messages=messages,
                               temperature=0, max_tokens=8)  # fmt: skip
    by_folder = client.chat.completions.create(model=model_dir.name, messages=messages, temperature=0, max_tokens=8)
    assert reply.choices[0].message.content == by_folder.choices[0].message.content
    assert by_folder.choices[0].message.content


# ----------------------------------------------------------------- raw SSE


def sse_events(base: str, body: dict) -> list[bytes]:
    """A streamed request's body split into events on blank lines only, as
    most SSE readers split it (``vllm bench serve`` among them)."""
    with httpx.Client(timeout=120) as http, http.stream("POST", f"{base}/chat/completions", json=body) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = b"".join(response.iter_bytes())
    assert b"\r" not in raw and raw.endswith(b"\n\n"), raw[-200:]
    return raw[: -len(b"\n\n")].split(b"\n\n")


def data_payloads(events: list[bytes]) -> list[dict]:
    """The JSON of each event; every event is one ``data:`` line (no comment
    lines, no other fields), the last ``data: [DONE]``."""
    for event in events:
        assert event.startswith(b"data: ") and b"\n" not in event, event
    assert events[-1] == b"data: [DONE]"
    return [json.loads(event[len(b"data: ") :]) for event in events[:-1]]


def test_a_raw_sse_reader_splitting_on_blank_lines_reads_every_event(stack, client, served_name):
    body = {"model": served_name, "messages": [{"role": "user", "content": "Write a sentence about rivers."}],
            "max_tokens": 12, "temperature": 0}  # fmt: skip
    whole = client.chat.completions.create(**body)
    with_usage = data_payloads(sse_events(stack, {**body, "stream": True, "stream_options": {"include_usage": True}}))
    *chunks, usage_chunk = with_usage
    assert usage_chunk["choices"] == [], usage_chunk
    counts = ("prompt_tokens", "completion_tokens")
    assert [usage_chunk["usage"][c] for c in counts] == [getattr(whole.usage, c) for c in counts]
    assert all(chunk.get("usage") is None for chunk in chunks)
    without_usage = data_payloads(sse_events(stack, {**body, "stream": True}))
    assert all(chunk.get("usage") is None for chunk in without_usage)
    for streamed in (chunks, without_usage):
        deltas = [chunk["choices"][0]["delta"].get("content") or "" for chunk in streamed]
        assert "".join(deltas) == whole.choices[0].message.content and len([d for d in deltas if d]) > 1


# ----------------------------------------------- what the openai client sends

VLLM_EXTRAS = {"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "ignore_eos": True, "skip_special_tokens": True,
               "stop_token_ids": [2], "min_tokens": 2, "include_stop_str_in_output": False}  # fmt: skip
# The fields both OpenAI references name, and those only its chat completions take.
OPENAI_EXTRAS = {"presence_penalty": 0.5, "frequency_penalty": 0.5, "logit_bias": {"30": -100}, "user": "user-7"}
OPENAI_CHAT_EXTRAS = {"safety_identifier": "a1b2c3", "prompt_cache_retention": "24h"}


def test_vllm_sampling_extras_and_openai_fields_are_accepted(client, served_name):
    chat = client.chat.completions.create(model=served_name, messages=[{"role": "user", "content": "Say hello."}],
                                          max_tokens=4, temperature=0, extra_body=VLLM_EXTRAS, **OPENAI_EXTRAS,
                                          **OPENAI_CHAT_EXTRAS)  # fmt: skip
    text = client.completions.create(model=served_name, prompt="Once upon a time", max_tokens=4, temperature=0,
                                     extra_body=VLLM_EXTRAS, **OPENAI_EXTRAS)  # fmt: skip
    for reply in (chat, text):
        assert 2 <= reply.usage.completion_tokens <= 4, reply.usage


def test_a_conversation_sent_back_as_the_client_returned_it_is_accepted(client, served_name):
    """Names on messages (multi-agent frameworks) and the assistant's message as
    the client returned it, its ``null`` fields included."""
    first = [{"role": "user", "content": "Say hello.", "name": "alice"}]
    reply = client.chat.completions.create(model=served_name, messages=first, max_tokens=4, temperature=0)
    assistant = {**reply.choices[0].message.model_dump(), "tool_calls": None, "function_call": None, "refusal": None}
    follow_up = [*first, assistant, {"role": "user", "content": "Again.", "name": "bob"}]
    again = client.chat.completions.create(model=served_name, messages=follow_up, max_tokens=4, temperature=0)
    assert again.usage.prompt_tokens > reply.usage.prompt_tokens and again.choices[0].message.content is not None


def test_an_unknown_field_is_ignored_and_named_in_a_header(client, served_name):
    messages = [{"role": "user", "content": "Say hello."}]
    raw = client.chat.completions.with_raw_response.create(model=served_name, messages=messages, max_tokens=4,
                                                           temperature=0, extra_body={"foo_bar": 1})  # fmt: skip
    assert "foo_bar" in raw.headers.get(IGNORED_FIELDS_HEADER, ""), dict(raw.headers)
    plain = client.chat.completions.create(model=served_name, messages=messages, max_tokens=4, temperature=0)
    assert raw.parse().choices[0].message.content == plain.choices[0].message.content


# ---------------------------------------------------------------- /v1/models


def test_models_have_what_vllm_bench_serve_reads(client, served_name):
    (model,) = client.models.list().data
    assert model.id == HF_ID == served_name  # the first --served-model-name
    # vllm bench serve loads its tokenizer by `root`: the Hugging Face id the engine knows.
    assert model.owned_by and model.model_extra["root"] == HF_ID and model.model_extra["parent"] is None, model


ECHO_CONTEXT = "Question: which planet is known as the red planet?\nAnswer:"
ECHO_CHOICES = [" Mars", " Venus", " Jupiter", " Saturn"]


def prompt_logprobs_reference(reference_model, ids: list[int]) -> list[float]:
    """Each token's logprob after the ones before it (the first has none), by transformers."""
    import torch

    with torch.no_grad():
        logprobs = torch.log_softmax(reference_model(torch.tensor([ids])).logits[0].double(), dim=-1)
    return [logprobs[p - 1, ids[p]].item() for p in range(1, len(ids))]


def test_echo_with_logprobs_scores_a_token_prompt_as_lm_eval_asks(client, served_name, tokenizer, reference_model):
    ids = tokenizer.encode(ECHO_CONTEXT + ECHO_CHOICES[0], add_special_tokens=False)
    # lm-eval's local-completions loglikelihood request.
    reply = client.completions.create(
        model=served_name, prompt=ids, max_tokens=1, temperature=0, logprobs=1, echo=True, seed=1234
    )
    (choice,) = reply.choices
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert choice.text.startswith(tokenizer.decode(ids)) and len(choice.text) > len(tokenizer.decode(ids))
    assert lp.token_logprobs[1 : len(ids)] == pytest.approx(prompt_logprobs_reference(reference_model, ids), abs=1e-6)
    for logprob, top in zip(lp.token_logprobs[1:], lp.top_logprobs[1:], strict=True):
        assert 1 <= len(top) <= 2 and max(top.values()) >= logprob  # the token itself is among them
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert reply.usage.prompt_tokens == len(ids) and reply.usage.completion_tokens == 1


def test_echo_of_a_text_prompt_with_max_tokens_0_is_the_prompt_alone(client, served_name, tokenizer, reference_model):
    reply = client.completions.create(model=served_name, prompt=ECHO_CONTEXT, max_tokens=0, echo=True, logprobs=0)
    (choice,) = reply.choices
    ids = tokenizer.encode(ECHO_CONTEXT)  # as a text prompt is tokenized (SmolLM2 adds no BOS)
    assert choice.text == ECHO_CONTEXT and choice.finish_reason == "length"
    assert choice.logprobs.token_logprobs[0] is None and len(choice.logprobs.tokens) == len(ids)
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(
        prompt_logprobs_reference(reference_model, ids), abs=1e-6
    )
    assert reply.usage.completion_tokens == 0
    plain = client.completions.create(model=served_name, prompt=ECHO_CONTEXT, max_tokens=3, temperature=0, echo=True)
    assert plain.choices[0].text.startswith(ECHO_CONTEXT) and plain.choices[0].logprobs is None


def test_choices_sharing_a_context_in_one_request_score_it_once_and_equal_separate_requests(
    client, served_name, tokenizer
):
    prompts = [tokenizer.encode(ECHO_CONTEXT * 3 + c, add_special_tokens=False) for c in ECHO_CHOICES]
    together = client.completions.create(model=served_name, prompt=prompts, max_tokens=1, logprobs=1, echo=True,
                                         temperature=0)  # fmt: skip
    # The context was computed once: the other choices were served its blocks by the cache.
    context_blocks = len(tokenizer.encode(ECHO_CONTEXT * 3, add_special_tokens=False)) // 16
    assert together.usage.prompt_tokens_details.cached_tokens >= 3 * (context_blocks - 1) * 16
    for prompt, choice in zip(prompts, together.choices, strict=True):
        alone = client.completions.create(model=served_name, prompt=prompt, max_tokens=1, logprobs=1, echo=True,
                                          temperature=0).choices[0]  # fmt: skip
        assert choice.logprobs.tokens == alone.logprobs.tokens
        assert choice.logprobs.token_logprobs[1:] == pytest.approx(alone.logprobs.token_logprobs[1:], abs=1e-6)
        assert choice.logprobs.top_logprobs[1:-1] == [
            pytest.approx(top, abs=1e-6) for top in alone.logprobs.top_logprobs[1:-1]
        ]


def test_a_streamed_echo_sends_the_prompt_first(stack, served_name, tokenizer):
    ids = tokenizer.encode(ECHO_CONTEXT, add_special_tokens=False)
    body = {"model": served_name, "prompt": ids, "max_tokens": 2, "temperature": 0, "echo": True, "logprobs": 2,
            "stream": True}  # fmt: skip
    with httpx.stream("POST", f"{stack}/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        events = [json.loads(e[len("data: ") :]) for e in response.read().decode().split("\n\n") if e.strip()
                  and e != "data: [DONE]"]  # fmt: skip
    first = events[0]["choices"][0]
    assert first["text"] == tokenizer.decode(ids) and first["logprobs"]["token_logprobs"][0] is None
    assert len(first["logprobs"]["tokens"]) == len(ids)
    generated = [t for e in events[1:] for c in e["choices"] for t in (c["logprobs"] or {}).get("tokens", [])]
    assert len(generated) == 2


def test_forks_of_an_echoed_prompt_share_its_scores(client, served_name, tokenizer):
    ids = tokenizer.encode(ECHO_CONTEXT * 3, add_special_tokens=False)
    reply = client.completions.create(model=served_name, prompt=ids, n=3, max_tokens=1, logprobs=1, echo=True,
                                      temperature=0)  # fmt: skip
    first, *others = [c.logprobs for c in reply.choices]
    assert all(o.token_logprobs == first.token_logprobs and o.tokens == first.tokens for o in others)
    alone = client.completions.create(model=served_name, prompt=ids, max_tokens=1, logprobs=1, echo=True, temperature=0)
    assert first.token_logprobs[1:-1] == pytest.approx(alone.choices[0].logprobs.token_logprobs[1:-1], abs=1e-6)
    # usage counts the prompt once (its first fork's); the forks' own cache hits are in the daemon's stats only
    assert reply.usage.prompt_tokens == len(ids)
