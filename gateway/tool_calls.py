"""Tool calling, behind both public APIs: what a request's ``tool_choice``
makes the engine enforce, and the calls read out of what it wrote.

- ``auto`` (the default with tools): the model chooses. Its text streams
  as it comes until a call begins (``<tool_call>``, ``kvd.common.tool_prompt``);
  from there it is held, and the last message carries the calls parsed out
  of it, with what was held and is no call as text.
- ``required``: the output is a JSON array of calls, each
  ``{"name": ..., "arguments": ...}`` valid against its function's
  parameters schema (one call unless ``parallel``), enforced by the
  sampler's grammar (``inference.constraints``); ``function``: that
  function's arguments object, enforced the same way. Either way the text
  is held whole and comes back as calls.
- ``none``: the tools are shown to the model; the output is text.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence

from kvd.common import tool_prompt
from kvd.common.field_error import FieldError
from kvd.common.tool_prompt import CALL_OPEN, Call
from kvd_api.engine.v1 import engine_pb2 as epb
from kvd_api.gateway.v1 import gateway_pb2 as pb

FIELD = "tool_choice"


def constrain(sampling: epb.SamplingParams, request: pb.GenerateRequest) -> None:
    """Sets the constraint a forced ``tool_choice`` needs on the engine's sampling.

    Raises:
        FieldError: a tool choice without tools, of an unknown function, or
            forced beside a constraint of the request's own.
    """
    choice = request.tool_choice.WhichOneof("choice")
    tools = list(request.chat.tools) if request.WhichOneof("prompt") == "chat" else []
    if choice not in ("required", "function"):
        return  # none, auto (unset: auto): nothing to enforce, with tools or without
    if not tools:
        raise FieldError(FIELD, f"{FIELD}: {choice} needs tools (none were given)")
    if sampling.HasField("constraint"):
        raise FieldError(FIELD, f"{FIELD}: a forced call and an output constraint cannot both be given")
    if choice == "function":
        tool = next((t for t in tools if t.name == request.tool_choice.function), None)
        if tool is None:
            names = ", ".join(t.name for t in tools)
            raise FieldError(FIELD, f"{FIELD}: no tool is named {request.tool_choice.function!r} (tools: {names})")
        sampling.constraint.json_schema = json.dumps(tool_prompt.parameters(tool))
        return
    calls = {"type": "array", "items": {"anyOf": [_call_schema(t) for t in tools]}, "minItems": 1}
    if not request.tool_choice.parallel:
        calls["maxItems"] = 1
    sampling.constraint.json_schema = json.dumps(calls)


def _call_schema(tool: epb.Tool) -> dict:
    return {
        "type": "object",
        "properties": {"name": {"const": tool.name}, "arguments": tool_prompt.parameters(tool)},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def reader(request: pb.GenerateRequest) -> CallReader | None:
    """What reads the calls out of ``request``'s output (None: it may make none)."""
    if request.WhichOneof("prompt") != "chat" or not request.chat.tools:
        return None
    choice = request.tool_choice.WhichOneof("choice") or "auto"
    if choice == "none":
        return None
    return CallReader([t.name for t in request.chat.tools], choice, request.tool_choice.function)


class CallReader:
    """Holds back the text of one generation's calls and parses them at its end."""

    def __init__(self, names: Sequence[str], choice: str, function: str = "") -> None:
        self.names = list(names)
        self.choice = choice  # auto, required or function
        self.function = function
        self._held = ""
        self._calling = choice != "auto"  # a forced call holds everything

    def relay(self, replies: Iterator[pb.GenerateResponse]) -> Iterator[pb.GenerateResponse]:
        """``replies`` with the calls' text held back, and the calls on the last one."""
        for message in replies:
            message.text = self._feed(message.text)
            if message.finish_reason != epb.FINISH_REASON_UNSPECIFIED:
                text, calls = self._finish()
                message.text += text
                message.tool_calls.extend(call.as_pb() for call in calls)
            yield message

    def _feed(self, text: str) -> str:
        """The part of ``text`` that can be released now (auto: what comes before a call)."""
        self._held += text
        if self._calling:
            return ""
        start = self._held.find(CALL_OPEN)
        if start >= 0:
            self._calling = True
            released, self._held = self._held[:start], self._held[start:]
            return released
        keep = _open_prefix(self._held)  # the tail that may still become "<tool_call>"
        released, self._held = self._held[: len(self._held) - keep], self._held[len(self._held) - keep :]
        return released

    def _finish(self) -> tuple[str, list[Call]]:
        """The held text that is no call, and the calls."""
        held, self._held = self._held, ""
        if self.choice == "auto":
            return tool_prompt.parse(held, self.names)
        calls = self._forced_calls(held)
        return ("", calls) if calls else (held, [])

    def _forced_calls(self, text: str) -> list[Call]:
        """The calls of a forced output (none when it was cut short: its JSON is unfinished)."""
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return []
        if self.choice == "function":
            return [Call(self.function, json.dumps(value, ensure_ascii=False))] if isinstance(value, dict) else []
        calls = [tool_prompt.call_of(item, self.names) for item in value] if isinstance(value, list) else []
        return [c for c in calls if c is not None]


def _open_prefix(text: str) -> int:
    """The length of the longest tail of ``text`` that begins ``<tool_call>``."""
    for size in range(min(len(text), len(CALL_OPEN) - 1), 0, -1):
        if CALL_OPEN.startswith(text[-size:]):
            return size
    return 0
