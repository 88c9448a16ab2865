"""The Anthropic surface's request bodies (pydantic), as Anthropic's Messages API names their fields.

Every field either works, changes nothing, or is refused with a 400 naming it:

- implemented: ``model``, ``max_tokens``, ``system`` (a string or text
  blocks), ``messages`` (``user`` and ``assistant`` turns of a string or
  text blocks), ``temperature``, ``top_p``, ``top_k``, ``stop_sequences``,
  ``stream``, and ``cache_control`` on the top level, on system blocks and
  on message blocks (``gateway.cache_marks``), ``diagnostics``
  (``anthropic_diagnostics``);
- accepted, changing nothing: ``metadata``, ``service_tier``, a disabled
  ``thinking``;
- refused: blocks other than text (images, documents, tool use: not
  supported yet), ``tools``, ``tool_choice``, an enabled ``thinking``;
- any other field is ignored and named in the ``x-kvd-ignored-fields`` header.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from gateway.http_api.common import Int32
from gateway.http_api.openai_schemas import Body, CacheControl
from kvd.common.field_error import FieldError

#: How the text blocks of one message join into its content (as the OpenAI surface joins text parts).
BLOCK_JOINER = "\n"


class Diagnostics(Body):
    """``{"previous_message_id": "msg_..." | null}``: say why this request missed that one's cached prefix."""

    previous_message_id: str | None = None


class TextBlock(Body):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None


def _text_blocks(field: str, value: Any) -> Any:
    """Refuses blocks other than text with a message that says what is supported."""
    for i, block in enumerate(value if isinstance(value, list) else ()):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind != "text":
            raise FieldError(
                f"{field}[{i}].type",
                f"{field}[{i}]: a content block of type {kind!r}: only text blocks are supported",
            )
    return value


class Message(Body):
    role: Literal["user", "assistant"]
    content: str | list[TextBlock]

    @field_validator("content", mode="before")
    @classmethod
    def _only_text(cls, content):
        return _text_blocks("messages.content", content)

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else BLOCK_JOINER.join(b.text for b in self.content)


class MessagesRequest(Body):
    """``POST /v1/messages``'s body."""

    model: str
    max_tokens: int = Field(ge=1, lt=2**31)
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: Int32 | None = Field(default=None, ge=0)
    stop_sequences: list[str] | None = None
    stream: bool = False
    cache_control: CacheControl | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    thinking: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: dict[str, Any] | None = None
    diagnostics: Diagnostics | None = None

    @field_validator("system", mode="before")
    @classmethod
    def _only_text(cls, system):
        return _text_blocks("system", system)

    @field_validator("stop_sequences")
    @classmethod
    def _non_empty_stops(cls, stops):
        if stops and any(not s for s in stops):
            raise FieldError("stop_sequences", "stop_sequences: a stop sequence must not be empty")
        return stops

    @model_validator(mode="after")
    def _refuse_unsupported(self):
        if self.tools:
            raise FieldError("tools", "tools: not supported through /v1/messages yet (/v1/chat/completions has them)")
        if self.tool_choice is not None:
            raise FieldError("tool_choice", "tool_choice: tool use through /v1/messages is not supported yet")
        if self.thinking is not None and self.thinking.get("type") not in (None, "disabled"):
            raise FieldError("thinking", "thinking: extended thinking is not supported (leave it out or disable it)")
        return self

    def system_text(self) -> str | None:
        if self.system is None or self.system == []:
            return None
        return self.system if isinstance(self.system, str) else BLOCK_JOINER.join(b.text for b in self.system)


class CountTokensRequest(MessagesRequest):
    """``POST /v1/messages/count_tokens``'s body: a message request without ``max_tokens``."""

    max_tokens: int = Field(default=1, ge=1, lt=2**31)
