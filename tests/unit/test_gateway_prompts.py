"""The gateway's own tokenizing and prompt composition, with SmolLM2's real
tokenizer loaded from the files an engine serves, and templates cached
against the real Redis at 127.0.0.1:6379."""

from __future__ import annotations

import pytest

from gateway.prompts import own_ids, template_ids, templated_ids
from gateway.relay import EngineRequest, gateway_response
from gateway.request_checks import check_create
from gateway.router import RouteKey
from gateway.template_cache import TemplateCache
from gateway.templates import Template, TemplateNotFound
from gateway.tokenizer import GatewayTokenizer
from inference import model_store
from inference.service import tokenizer_files
from kvd.common import chat as prompts
from kvd.common.field_error import FieldError
from kvd_api.engine.v1 import engine_pb2 as epb
from kvd_api.gateway.v1 import gateway_pb2 as pb

SYSTEM = [
    ("system", "You are the support assistant of ACME Corp. ACME sells anvils and rockets."),
    ("user", "Do you ship abroad?"),
    ("assistant", "Yes, to every country, within two days."),
]
QUESTION = [("user", "What do you sell?")]


@pytest.fixture(scope="module")
def reference(model_dir):
    """The engine's tokenizer, as the engine loads it."""
    return model_store.load_tokenizer(model_dir)


@pytest.fixture(scope="module")
def files(reference) -> dict[str, bytes]:
    return tokenizer_files(reference)


@pytest.fixture(scope="module")
def tokenizer(files) -> GatewayTokenizer:
    return GatewayTokenizer(lambda: files)


def rendered(reference, messages, add_generation_prompt: bool) -> list[int]:
    dicts = [{"role": r, "content": c} for r, c in messages]
    encoded = reference.apply_chat_template(dicts, add_generation_prompt=add_generation_prompt, tokenize=True)
    return list(encoded["input_ids"])


def chat_request(messages, **chat) -> pb.GenerateRequest:
    request = pb.GenerateRequest(template="t", chat=epb.ChatPrompt(**chat))
    request.chat.messages.extend(epb.ChatMessage(role=r, content=c) for r, c in messages)
    return request


def template(content: str, token_ids: list[int], messages=()) -> Template:
    return Template("acme", "t", content, token_ids, "", 0.0, None, 0, tuple(messages))


def test_text_is_tokenized_as_the_engine_does(tokenizer, reference):
    text = " Customer: what do you sell?  Émile asks — twice. 北京"
    # With the tokenizer's special tokens (a BOS where the model has one), as vLLM's completions.
    assert tokenizer.text_ids(text) == reference.encode(text) == prompts.text_ids(reference, text)
    assert own_ids(tokenizer, pb.GenerateRequest(text=text)) == reference.encode(text)
    assert tokenizer.text_ids(text, add_special_tokens=False) == reference.encode(text, add_special_tokens=False)
    chat = chat_request(QUESTION)
    assert own_ids(tokenizer, chat) == rendered(reference, QUESTION, True)


def test_a_chat_template_renders_with_the_request_token_for_token(tokenizer, reference):
    ids = template_ids(tokenizer, "", SYSTEM)
    assert ids == rendered(reference, SYSTEM, False)
    chat = template("", ids, SYSTEM)

    prompt, count = templated_ids(tokenizer, chat, chat_request(QUESTION))
    assert prompt == rendered(reference, SYSTEM + QUESTION, True)
    assert count == len(ids) and prompt[:count] == ids
    # The model's default system prompt is not added: the template brings its own.
    assert "SmolLM" not in reference.decode(prompt)

    without_header, _ = templated_ids(tokenizer, chat, chat_request(QUESTION, add_generation_prompt=False))
    assert without_header == rendered(reference, SYSTEM + QUESTION, False)
    alone, count = templated_ids(tokenizer, chat, pb.GenerateRequest(template="t"))
    assert alone == rendered(reference, SYSTEM, True) and count == len(ids)


def test_a_text_template_puts_its_tokens_before_the_prompt(tokenizer, reference):
    ids = template_ids(tokenizer, "You are the support assistant of ACME Corp.", ())
    text = template("You are the support assistant of ACME Corp.", ids)
    prompt, count = templated_ids(tokenizer, text, pb.GenerateRequest(template="t", text=" Hi!"))
    assert prompt == ids + reference.encode(" Hi!", add_special_tokens=False) and count == len(ids)
    prompt, _ = templated_ids(tokenizer, text, pb.GenerateRequest(template="t", token_ids=epb.TokenIds(ids=[5, 6])))
    assert prompt == ids + [5, 6]


def test_mismatched_template_and_prompt_forms_are_refused(tokenizer):
    text = template("Some text.", [1, 2, 3])
    with pytest.raises(ValueError, match="holds text, not chat messages"):
        templated_ids(tokenizer, text, chat_request(QUESTION))
    chat = template("", [1, 2, 3], SYSTEM)
    with pytest.raises(ValueError, match="holds chat messages"):
        templated_ids(tokenizer, chat, pb.GenerateRequest(template="t", text="Hi"))
    with pytest.raises(ValueError, match="not both"):
        template_ids(tokenizer, "text", SYSTEM)
    with pytest.raises(ValueError, match="content must not be empty"):
        template_ids(tokenizer, "", ())


def test_create_requests_give_content_or_messages():
    check_create(pb.CreateTemplateRequest(name="t", content="Some text."))
    check_create(pb.CreateTemplateRequest(name="t", messages=[epb.ChatMessage(role=r, content=c) for r, c in SYSTEM]))
    with pytest.raises(ValueError, match="^content must not be empty"):
        check_create(pb.CreateTemplateRequest(name="t"))
    with pytest.raises(ValueError, match="^content, messages: .*not both"):
        check_create(pb.CreateTemplateRequest(name="t", content="x", messages=[epb.ChatMessage(role="system")]))
    with pytest.raises(ValueError, match=r"^messages\[1\]\.role is empty"):
        check_create(pb.CreateTemplateRequest(name="t", messages=[epb.ChatMessage(role="system"), epb.ChatMessage()]))


def test_messages_whose_rendering_is_not_a_stable_prefix_are_refused(files):
    # A chat template that marks the last message: the template's messages
    # render one way alone and another once a conversation follows them.
    marking = b"{% for m in messages %}{% if loop.last %}LAST {% endif %}{{ m['content'] }}\n{% endfor %}"
    unstable = GatewayTokenizer(lambda: {**files, "chat_template.jinja": marking})
    with pytest.raises(ValueError, match="cannot be a cached prefix"):
        template_ids(unstable, "", SYSTEM)


def test_a_tokenizer_is_fetched_once(files):
    fetched = []

    def fetch():
        fetched.append(1)
        return files

    tokenizer = GatewayTokenizer(fetch)
    tokenizer.text_ids("one")
    tokenizer.chat_ids(QUESTION, True)
    assert len(fetched) == 1


def test_the_gateway_passes_on_every_field_an_engine_returns():
    """Each GenerateResponse and Usage field of the engine (request ids aside)
    exists in the gateway's and is copied."""
    engine_fields = {f.name for f in epb.GenerateResponse.DESCRIPTOR.fields} - {"request_id"}
    assert engine_fields <= {f.name for f in pb.GenerateResponse.DESCRIPTOR.fields}
    # (The daemon's word on each cache mark becomes the cache creation counts: test_cache_marks.)
    usage_fields = {f.name for f in epb.Usage.DESCRIPTOR.fields} - {"marks"}
    assert usage_fields <= {f.name for f in pb.Usage.DESCRIPTOR.fields}

    message = epb.GenerateResponse(
        request_id="r",
        token_ids=[1, 2],
        text="ab",
        logprobs=[-0.5, -0.25],
        finish_reason=epb.FINISH_REASON_LENGTH,
        top_logprobs=[epb.TopLogprobs(token_ids=[1, 7], logprobs=[-0.5, -1.0])] * 2,
        usage=epb.Usage(prompt_tokens=9, cached_prompt_tokens=8, completion_tokens=2, time_to_first_token_s=0.5,
                        host_cached_prompt_tokens=4, disk_cached_prompt_tokens=2),
    )  # fmt: skip
    assert all(getattr(message.usage, field) for field in usage_fields)  # none left at its default
    out = gateway_response(message, EngineRequest(epb.GenerateRequest(), 3, RouteKey()))
    for field in engine_fields - {"usage"}:
        assert getattr(out, field) == getattr(message, field), field
    for field in usage_fields:
        assert getattr(out.usage, field) == getattr(message.usage, field), field
    assert out.usage.template_tokens == 3


def test_cached_templates_follow_deletes_and_new_contents(store):
    """Two caches, as two gateways sharing one Redis."""
    here, there = TemplateCache(store), TemplateCache(store)
    store.create("acme", "bot", "first", [1, 2], 0, "", messages=[("system", "first")])
    assert here.get("acme", "bot").token_ids == [1, 2] and there.get("acme", "bot").messages == (("system", "first"),)
    assert here.get("acme", "bot") is here.get("acme", "bot")  # kept: no second read of the ids

    store.delete("acme", "bot")
    with pytest.raises(TemplateNotFound):
        there.get("acme", "bot")
    store.create("acme", "bot", "second", [3, 4, 5], 0, "")
    for cache in (here, there):
        fresh = cache.get("acme", "bot")
        assert (fresh.content, fresh.token_ids, fresh.messages) == ("second", [3, 4, 5], ())


def test_a_chat_template_that_refuses_the_messages_is_a_field_error_naming_them(files):
    strict = b"{% for m in messages %}{% if m['role'] == 'system' and not loop.first %}" \
        b"{{ raise_exception('a system message comes first') }}{% endif %}{{ m['content'] }}{% endfor %}"  # fmt: skip
    refusing = GatewayTokenizer(lambda: {**files, "chat_template.jinja": strict})
    with pytest.raises(FieldError, match="a system message comes first") as info:
        refusing.chat_ids([("user", "Hi"), ("system", "late")])
    assert info.value.field == "chat.messages"


def test_names_continuations_and_template_kwargs_reach_the_template(tokenizer, reference):
    prompt = epb.ChatPrompt(messages=[epb.ChatMessage(role="user", content="Hi", name="alice"),
                                      epb.ChatMessage(role="assistant", content="Hel")],
                            continue_final_message=True)  # fmt: skip
    expected = reference.apply_chat_template(
        [{"role": "user", "content": "Hi", "name": "alice"}, {"role": "assistant", "content": "Hel"}],
        continue_final_message=True, tokenize=True,
    )["input_ids"]  # fmt: skip
    assert tokenizer.chat_ids(prompt) == list(expected)
    assert reference.decode(expected).endswith("Hel")  # no end of turn: the model goes on with it
    prompt.chat_template_kwargs.update({"tokenize": False})
    with pytest.raises(FieldError, match="tokenize") as info:
        tokenizer.chat_ids(prompt)
    assert info.value.field == "chat.chat_template_kwargs"


def test_a_text_after_a_template_gets_no_special_tokens(tokenizer, files):
    with_bos = GatewayTokenizer(lambda: files)
    loaded = with_bos._loaded()
    loaded.add_bos_token = True  # as a model whose tokenizer adds a BOS (SmolLM2's adds none)
    if loaded.encode("x")[:1] != [loaded.bos_token_id]:
        pytest.skip("this tokenizer cannot be made to add a BOS")
    text = template("Intro.", with_bos.text_ids("Intro."))
    prompt, _ = templated_ids(with_bos, text, pb.GenerateRequest(template="t", text=" Hi!"))
    assert prompt.count(loaded.bos_token_id) == 1 and prompt[0] == loaded.bos_token_id
