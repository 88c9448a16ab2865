"""Tools in a chat prompt, and the calls a model writes back: one format,
read by the renderer (``kvd.common.chat``, in the engine and the gateway
alike) and by the gateway's parser (``gateway.tool_calls``).

A chat template that knows tools (it reads a ``tools`` variable, as Qwen's,
Llama 3.1's and Mistral's do) gets them through that variable, with the
conversation's earlier calls and results in Hugging Face's message shape.
A template that does not (the default SmolLM2) gets kvd's own format:

- the tools, one JSON object a line, inside ``<tools></tools>`` in the
  system message (after its text: its prefix stays the same turn after
  turn, so it is cached), with how to call them;
- each call as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  (the format Hermes and Qwen models are trained on), an assistant's
  earlier calls written back the same way;
- each result as a user message ``<tool_response>...</tool_response>``
  (consecutive results in one message: templates that want user and
  assistant to alternate accept it).

The parser reads that call format out of any model's output (``parse``).
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvd_api.engine.v1 import engine_pb2 as epb

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"

_INSTRUCTIONS = (
    "You may call one or more functions to help answer. The functions, as JSON schemas of their arguments, "
    "are inside <tools></tools>:\n<tools>\n{tools}\n</tools>\n"
    "To call a function, reply with exactly one line per call:\n"
    '<tool_call>{{"name": "<function name>", "arguments": <its arguments as a JSON object>}}</tool_call>\n'
    "The results come back inside <tool_response></tool_response>. When no call is needed, answer directly."
)


@dataclass(frozen=True)
class Call:
    """A parsed call: its function's name and its arguments as JSON text."""

    name: str
    arguments: str

    def as_pb(self) -> epb.ToolCall:
        return epb.ToolCall(id=new_call_id(), name=self.name, arguments=self.arguments)


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def template_knows_tools(tokenizer) -> bool:
    """Whether the model's chat template reads a ``tools`` variable."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):  # several named templates
        template = " ".join(template.values())
    return re.search(r"\btools\b", template) is not None


def parameters(tool: epb.Tool) -> dict[str, Any]:
    """A tool's arguments schema (an empty one: any object)."""
    return json.loads(tool.parameters) if tool.parameters else {"type": "object"}


def function_dict(tool: epb.Tool) -> dict[str, Any]:
    """A tool as OpenAI and Hugging Face templates describe it."""
    function: dict[str, Any] = {"name": tool.name}
    if tool.description:
        function["description"] = tool.description
    function["parameters"] = parameters(tool)
    return function


# ------------------------------------------------------------- rendering


def template_messages(messages: Sequence[epb.ChatMessage], plain: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages in Hugging Face's shape for a template that knows tools:
    ``plain`` (each message's role, content and name: ``chat.message_dicts``)
    with the calls, their arguments as objects, and the results' call ids."""
    for entry, m in zip(plain, messages, strict=True):
        if m.tool_calls:
            entry["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": _arguments(c)}}
                for c in m.tool_calls
            ]
        if m.tool_call_id:
            entry["tool_call_id"] = m.tool_call_id
    return plain


def kvd_messages(
    messages: Sequence[epb.ChatMessage], plain: list[dict[str, Any]], tools: Sequence[epb.Tool]
) -> list[dict[str, Any]]:
    """The messages in kvd's format (see the module's docstring), plain roles
    and text only, for any chat template: ``plain`` (each message's role,
    content and name: ``chat.message_dicts``) with the tools, calls and results written in."""
    out: list[dict[str, Any]] = []
    pairs = list(zip(messages, plain, strict=True))
    if tools:
        listed = "\n".join(json.dumps(function_dict(t), ensure_ascii=False) for t in tools)
        section = _INSTRUCTIONS.format(tools=listed)
        if pairs and pairs[0][0].role == "system":
            out.append({**pairs[0][1], "content": f"{pairs[0][0].content}\n\n{section}"})
            pairs = pairs[1:]
        else:
            out.append({"role": "system", "content": section})
    previous_role = ""
    for m, entry in pairs:
        if m.role == "tool":
            response = f"{RESPONSE_OPEN}\n{m.content}\n{RESPONSE_CLOSE}"
            if previous_role == "tool":  # the results of one turn's calls: one message
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response})
        else:
            if m.tool_calls:
                calls = "\n".join(call_text(c.name, _arguments(c)) for c in m.tool_calls)
                entry["content"] = f"{m.content}\n{calls}" if m.content else calls
            out.append(entry)
        previous_role = m.role
    return out


def call_text(name: str, arguments: Any) -> str:
    """One call as kvd's format writes it."""
    return f"{CALL_OPEN}{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}{CALL_CLOSE}"


def _arguments(call: epb.ToolCall) -> Any:
    """A call's arguments as an object (a client sends them as JSON text; text that is not JSON stays text)."""
    try:
        return json.loads(call.arguments) if call.arguments else {}
    except json.JSONDecodeError:
        return call.arguments


# --------------------------------------------------------------- parsing

_CALL = re.compile(re.escape(CALL_OPEN) + r"\s*(.*?)\s*(?:" + re.escape(CALL_CLOSE) + r"|$)", re.DOTALL)


def parse(text: str, known: Sequence[str]) -> tuple[str, list[Call]]:
    """The calls written in ``text`` in kvd's format (a last one left
    unclosed at the end too), and the text around them. A block that is not
    a call of a known function stays in the text, as the model wrote it."""
    calls: list[Call] = []
    kept: list[str] = []
    at = 0
    for match in _CALL.finditer(text):
        call = call_of(match.group(1), known)
        if call is None:
            continue
        kept.append(text[at : match.start()])
        at = match.end()
        calls.append(call)
    kept.append(text[at:])
    return "".join(kept).strip() if calls else text, calls


def call_of(payload: str | Any, known: Sequence[str]) -> Call | None:
    """A call from its JSON (text or parsed): ``name`` and ``arguments`` (or
    Llama's ``parameters``), the name one of ``known``; None otherwise."""
    try:
        value = json.loads(payload) if isinstance(payload, str) else payload
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or value.get("name") not in known:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as JSON text
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return Call(value["name"], json.dumps(arguments, ensure_ascii=False))
