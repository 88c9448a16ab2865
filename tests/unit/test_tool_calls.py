"""Tool calling's parts: kvd's prompt format, the parser, what a tool
choice makes the engine enforce, and the reader that holds a call's text
back from a stream (whatever its chunking, the same text and calls)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from gateway import tool_calls
from gateway.tool_calls import CallReader
from kvd.common import tool_prompt
from kvd.common.chat import message_dicts
from kvd.common.field_error import FieldError
from kvd_api.engine.v1 import engine_pb2 as epb
from kvd_api.gateway.v1 import gateway_pb2 as pb

WEATHER = epb.Tool(
    name="get_weather",
    description="The weather in a city",
    parameters=json.dumps({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}),
)
ADD = epb.Tool(name="add", parameters=json.dumps({"type": "object", "properties": {"a": {"type": "number"}}}))
NAMES = ["get_weather", "add"]


def chat_request(**choice) -> pb.GenerateRequest:
    chat = epb.ChatPrompt(messages=[epb.ChatMessage(role="user", content="Hi")], tools=[WEATHER, ADD])
    return pb.GenerateRequest(chat=chat, tool_choice=pb.ToolChoice(**choice))


def test_kvd_format_lists_tools_after_the_system_text_and_merges_results():
    messages = [
        epb.ChatMessage(role="system", content="Be brief."),
        epb.ChatMessage(role="user", content="Weather in Paris and Rome?"),
        epb.ChatMessage(role="assistant", tool_calls=[
            epb.ToolCall(id="1", name="get_weather", arguments='{"city": "Paris"}'),
            epb.ToolCall(id="2", name="get_weather", arguments='{"city": "Rome"}'),
        ]),
        epb.ChatMessage(role="tool", tool_call_id="1", content="12C"),
        epb.ChatMessage(role="tool", tool_call_id="2", content="20C"),
    ]  # fmt: skip
    out = tool_prompt.kvd_messages(messages, message_dicts(messages), [WEATHER])
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be brief.\n\n") and '"name": "get_weather"' in out[0]["content"]
    assert out[2]["content"].count("<tool_call>") == 2
    assert tool_prompt.parse(out[2]["content"], NAMES)[1] == [
        tool_prompt.Call("get_weather", '{"city": "Paris"}'),
        tool_prompt.Call("get_weather", '{"city": "Rome"}'),
    ]
    assert out[3]["content"] == "<tool_response>\n12C\n</tool_response>\n<tool_response>\n20C\n</tool_response>"


def test_parse_keeps_text_that_is_no_known_call():
    text = 'Sure.\n<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>\n<tool_call>{"name": "rm"}</tool_call>'
    rest, calls = tool_prompt.parse(text, NAMES)
    assert calls == [tool_prompt.Call("add", '{"a": 1}')]
    assert rest == 'Sure.\n\n<tool_call>{"name": "rm"}</tool_call>'
    assert tool_prompt.parse("no calls <tool_call>{broken", NAMES) == ("no calls <tool_call>{broken", [])
    unclosed = tool_prompt.parse('<tool_call>{"name": "add", "parameters": {"a": 2}}', NAMES)
    assert unclosed == ("", [tool_prompt.Call("add", '{"a": 2}')])  # Llama's key, and a call cut before its close


def test_a_named_choice_constrains_to_its_arguments_and_required_to_a_list_of_calls():
    sampling = epb.SamplingParams()
    tool_calls.constrain(sampling, chat_request(function="get_weather"))
    assert json.loads(sampling.constraint.json_schema) == json.loads(WEATHER.parameters)
    sampling = epb.SamplingParams()
    tool_calls.constrain(sampling, chat_request(required=True))
    schema = json.loads(sampling.constraint.json_schema)
    jsonschema.validate([{"name": "add", "arguments": {"a": 1}}], schema)
    with pytest.raises(jsonschema.ValidationError):  # one call unless parallel
        jsonschema.validate([{"name": "add", "arguments": {}}, {"name": "add", "arguments": {}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_weather", "arguments": {}}], schema)  # its required city
    for choice in ({"auto": True}, {"none": True}, {}):
        sampling = epb.SamplingParams()
        tool_calls.constrain(sampling, chat_request(**choice))
        assert not sampling.HasField("constraint")


def test_a_bad_tool_choice_is_refused_naming_it():
    with pytest.raises(FieldError, match="no tool is named 'rm'"):
        tool_calls.constrain(epb.SamplingParams(), chat_request(function="rm"))
    constrained = epb.SamplingParams(constraint=epb.Constraint(regex="a"))
    with pytest.raises(FieldError, match="cannot both be given"):
        tool_calls.constrain(constrained, chat_request(required=True))
    no_tools = pb.GenerateRequest(text="Hi", tool_choice=pb.ToolChoice(required=True))
    with pytest.raises(FieldError, match="needs tools") as err:
        tool_calls.constrain(epb.SamplingParams(), no_tools)
    assert err.value.field == "tool_choice"
    tool_calls.constrain(epb.SamplingParams(), pb.GenerateRequest(text="Hi", tool_choice=pb.ToolChoice(auto=True)))


def replies(pieces: list[str]) -> list[pb.GenerateResponse]:
    out = [pb.GenerateResponse(text=piece) for piece in pieces]
    out[-1].finish_reason = epb.FINISH_REASON_EOS
    return out


TEXT = 'Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'


@pytest.mark.parametrize("size", [1, 3, 7, len(TEXT)])
def test_the_reader_releases_the_text_before_a_call_and_the_call_at_the_end(size):
    pieces = [TEXT[i : i + size] for i in range(0, len(TEXT), size)]
    out = list(CallReader(NAMES, "auto").relay(iter(replies(pieces))))
    streamed = "".join(m.text for m in out)
    assert streamed == "Let me check. "
    assert all("<" not in m.text for m in out)
    (call,) = out[-1].tool_calls
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Oslo"}) and call.id.startswith("call_")


def test_the_reader_passes_text_without_calls_through_and_forced_calls_whole():
    plain = list(CallReader(NAMES, "auto").relay(iter(replies(["a < b", " and <tool", "s> too"]))))
    assert "".join(m.text for m in plain) == "a < b and <tools> too" and not plain[-1].tool_calls
    forced = list(CallReader(NAMES, "function", "add").relay(iter(replies(['{"a":', " 3}"]))))
    assert [m.text for m in forced] == ["", ""] and forced[-1].tool_calls[0].arguments == '{"a": 3}'
    required = list(CallReader(NAMES, "required").relay(iter(replies(['[{"name": "add", "arguments": {}}]']))))
    assert [c.name for c in required[-1].tool_calls] == ["add"]
    cut_short = list(CallReader(NAMES, "required").relay(iter(replies(['[{"name": "add", "argu']))))
    assert cut_short[-1].text == '[{"name": "add", "argu' and not cut_short[-1].tool_calls  # given back as text


def test_the_tool_prompt_says_how_tools_reach_the_template(tokenizer):
    """SmolLM2's template reads no tools: auto renders kvd's format, as kvd does;
    template hands them to the template, which leaves them out."""
    from kvd.common.chat import chat_ids

    def rendered(mode) -> str:
        chat = epb.ChatPrompt(messages=[epb.ChatMessage(role="user", content="Hi")], tools=[WEATHER], tool_prompt=mode)
        return tokenizer.decode(chat_ids(tokenizer, chat))

    assert not tool_prompt.template_knows_tools(tokenizer)
    assert rendered(epb.TOOL_PROMPT_AUTO) == rendered(epb.TOOL_PROMPT_KVD)
    assert "<tools>" in rendered(epb.TOOL_PROMPT_KVD) and "<tools>" not in rendered(epb.TOOL_PROMPT_TEMPLATE)
    plain = epb.ChatPrompt(messages=[epb.ChatMessage(role="user", content="Hi")])
    assert rendered(epb.TOOL_PROMPT_TEMPLATE) == tokenizer.decode(chat_ids(tokenizer, plain))


def test_tools_with_bad_parameters_are_refused_naming_them(tokenizer):
    from kvd.common.chat import chat_ids

    for tools, reason in (([epb.Tool(name="f", parameters="{")], "not JSON"), ([ADD, ADD], "two tools"),
                          ([epb.Tool(name="f", parameters="[1]")], "not a JSON schema")):  # fmt: skip
        chat = epb.ChatPrompt(messages=[epb.ChatMessage(role="user", content="Hi")], tools=tools)
        with pytest.raises(FieldError, match=reason) as err:
            chat_ids(tokenizer, chat)
        assert err.value.field == "chat.tools"
