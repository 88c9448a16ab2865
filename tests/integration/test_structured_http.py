"""Structured outputs and tool calls through the gateway, as clients call
them: the ``openai`` client's ``parse`` with a pydantic model, LangChain's
``with_structured_output`` and a ``bind_tools`` agent loop of three turns
(its prefix cached more each turn), forced calls whose arguments always
validate, streamed calls that reassemble to the whole ones, vLLM's
``structured_outputs`` on completions, the gRPC API's tool choice, and
refusals that hold nothing.

One stack for the module: a daemon, a float32 engine on the real SmolLM2 and
a gateway on the real Redis (its gRPC port and its HTTP API)."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from pydantic import BaseModel

from gateway.client import GatewayClient
from kvd_api.engine.v1 import engine_pb2 as epb
from kvd_api.gateway.v1 import gateway_pb2 as pb
from tests.conftest import blocks_held, http_stack, wait_for

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 40}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Adds two numbers",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "number", "minimum": -1000, "maximum": 1000}, "b": {"type": "number"}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
QUESTIONS = ["What's the weather in Paris?", "Add 2 and 40.", "Is it cold in Oslo?", "What is 7 plus 8?"]


@pytest.fixture(scope="module")
def stack(model_dir):
    daemon = ["--block-size", "16", "--num-blocks", "512", "--lease-s", "2"]
    with http_stack(model_dir, daemon) as stack:
        yield stack


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


class City(BaseModel):
    name: str
    country: str
    population: int


def test_the_openai_clients_parse_returns_the_pydantic_model(client, model):
    reply = client.chat.completions.parse(
        model=model, messages=user("Tell me about Paris."), response_format=City, max_tokens=200, temperature=0
    )
    assert isinstance(reply.choices[0].message.parsed, City)


def test_sampled_outputs_of_a_json_schema_and_of_vllms_fields_validate(client, model):
    schema = City.model_json_schema()
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}}
    for seed, question in enumerate(QUESTIONS):
        reply = client.chat.completions.create(
            model=model, messages=user(question), response_format=fmt, max_tokens=200, temperature=1.0, seed=seed
        )
        jsonschema.validate(json.loads(reply.choices[0].message.content), schema)
    completion = client.completions.create(
        model=model, prompt="The year the war ended was", max_tokens=8, temperature=1.0,
        extra_body={"structured_outputs": {"regex": " (19|20)[0-9]{2}"}},
    )  # fmt: skip
    assert re.fullmatch(" (19|20)[0-9]{2}", completion.choices[0].text)
    choice = client.chat.completions.create(
        model=model, messages=user("Pick one."), max_tokens=8, extra_body={"guided_choice": ["left", "right"]}
    )
    assert choice.choices[0].message.content in ("left", "right")


def test_forced_calls_always_parse_against_their_functions_schema(client, model):
    for seed, question in enumerate(QUESTIONS):
        for choice in ("required", {"type": "function", "function": {"name": "add"}}):
            reply = client.chat.completions.create(
                model=model, messages=user(question), tools=TOOLS, tool_choice=choice, max_tokens=200,
                temperature=1.0, seed=seed, parallel_tool_calls=False,
            )  # fmt: skip
            assert reply.choices[0].finish_reason == "tool_calls"
            (call,) = reply.choices[0].message.tool_calls
            assert choice == "required" or call.function.name == "add"
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def few_shot_calls() -> list[dict]:
    """Three earlier turns in which the assistant called get_weather: the small model does it again."""
    messages = []
    for i, city in enumerate(("Paris", "Oslo", "Lima")):
        call = {"id": f"call_{i}", "type": "function",
                "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}  # fmt: skip
        messages += [{"role": "user", "content": f"Weather in {city}?"},
                     {"role": "assistant", "content": None, "tool_calls": [call]}]  # fmt: skip
    return messages


@pytest.mark.parametrize("choice", ["auto", "named"])
def test_streamed_call_deltas_reassemble_to_the_whole_call(client, model, choice):
    tool_choice = "auto" if choice == "auto" else {"type": "function", "function": {"name": "get_weather"}}
    kwargs = dict(model=model, messages=[*few_shot_calls(), *user("Weather in Rome?")], tools=TOOLS,
                  tool_choice=tool_choice, max_tokens=60, temperature=0)  # fmt: skip
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "tool_calls" and not whole.message.content
    calls: dict[int, dict] = {}
    finish, content = None, ""
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for choice_delta in chunk.choices:
            content += choice_delta.delta.content or ""
            finish = choice_delta.finish_reason or finish
            for delta in choice_delta.delta.tool_calls or ():
                entry = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
                entry["id"] += delta.id or ""
                entry["name"] += delta.function.name or ""
                entry["arguments"] += delta.function.arguments or ""
    (expected,) = whole.message.tool_calls
    assert finish == "tool_calls" and content == ""
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        ("get_weather", json.loads(expected.function.arguments))
    ]
    assert json.loads(expected.function.arguments) == {"city": "Rome"}
    assert calls[0]["id"].startswith("call_")


@pytest.fixture(scope="module")
def chat_model(stack, model):
    with pytest.MonkeyPatch.context() as patch:
        for variable in ("LANGSMITH_TRACING", "LANGCHAIN_TRACING_V2", "LANGCHAIN_TRACING"):
            patch.setenv(variable, "false")
        from langchain_openai import ChatOpenAI

        yield ChatOpenAI(base_url=stack.base_url, api_key="unused", model=model, temperature=0, max_retries=0,
                         max_tokens=200, timeout=300)  # fmt: skip


def test_langchains_with_structured_output_returns_the_model(chat_model):
    city = chat_model.with_structured_output(City).invoke("Tell me about Rome.")
    assert isinstance(city, City)


def test_a_langchain_bind_tools_agent_loop_of_three_turns_is_cached_more_each_turn(chat_model):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        return f"12 degrees and cloudy in {city}"

    agent = chat_model.bind_tools([get_weather], tool_choice="get_weather")
    messages: list = [HumanMessage("I am planning a trip. What's the weather in Lisbon?")]
    cached = []
    for turn in range(3):
        reply = agent.invoke(messages)
        (call,) = reply.tool_calls
        assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str)
        cached.append(reply.response_metadata["token_usage"]["prompt_tokens_details"]["cached_tokens"])
        messages += [reply, ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"])]
        messages.append(HumanMessage(f"And the day after ({turn + 1})?"))
    # Each turn's prompt begins with the last one's (tools, then the conversation so far).
    assert cached[0] < cached[1] < cached[2]


def test_the_grpc_api_takes_tools_and_a_tool_choice(stack):
    tools = [epb.Tool(name=t["function"]["name"], description=t["function"]["description"],
                      parameters=json.dumps(t["function"]["parameters"])) for t in TOOLS]  # fmt: skip
    chat = epb.ChatPrompt(messages=[epb.ChatMessage(role="user", content="Add 2 and 40.")], tools=tools)
    request = pb.GenerateRequest(
        chat=chat, tool_choice=pb.ToolChoice(function="add"), sampling=epb.SamplingParams(max_new_tokens=60)
    )
    with GatewayClient(stack.gateway.address, timeout_s=300) as gateway:
        reply = gateway.stub.Complete(request, timeout=300)
    (call,) = reply.tool_calls
    assert call.name == "add" and reply.text == ""
    jsonschema.validate(json.loads(call.arguments), SCHEMAS["add"])


@pytest.mark.parametrize(
    ("extra", "param", "reason"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
         None, "Unsupported type"),
        ({"extra_body": {"guided_regex": "(?<=a)b"}}, None, "Lookbehind"),
        ({"extra_body": {"guided_grammar": "root ::= nothing"}}, None, "not defined"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "rm"}}}, "tool_choice",
         "no tool is named 'rm'"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"extra_body": {"guided_regex": "a", "guided_choice": ["a"]}}, "guided_choice", "one output constraint"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}],
          "tool_choice": "required"}, None, "Unsupported type"),
    ],
)  # fmt: skip
def test_a_bad_constraint_or_tool_choice_is_400_naming_it_and_holds_nothing(stack, client, model, extra, param, reason):
    """``param``: the field, where one field alone gave the constraint (None:
    the engine refused it; the message names its kind)."""
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model, messages=user("Hi"), max_tokens=8, **extra)
    assert err.value.body["param"] == param and reason in err.value.body["message"], err.value.body
    assert wait_for(lambda: blocks_held(stack.daemon) == 0, 30)
