"""The OpenAI surface's request bodies (pydantic), as OpenAI's API names their fields.

Every model forbids fields it does not name, so a misspelt or unsupported
field is a 400 naming it rather than silently ignored. OpenAI fields kvd does
not implement are named here only to be refused with a clearer message
(``Unsupported``): a value other than the one that changes nothing (``n``
other than 1, a penalty other than 0, tools...) is a 400 naming the field.

The kvd fields beside OpenAI's: ``template`` (a named template, sent by the
``openai`` client with ``extra_body``), ``top_k`` and ``ignore_eos`` (as
vLLM's API names them).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from gateway.http_api.common import Int64
from kvd.common.field_error import FieldError

# field -> the value(s) that change nothing; anything else is refused.
_NO_OP: dict[str, tuple] = {
    "n": (None, 1),
    "best_of": (None, 1),
    "echo": (None, False),
    "suffix": (None, ""),
    "frequency_penalty": (None, 0, 0.0),
    "presence_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
    "logit_bias": (None, {}),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "parallel_tool_calls": (None,),
    "functions": (None, []),
    "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "verbosity": (None,),
    "web_search_options": (None,),
    "service_tier": (None, "auto", "default"),
    "store": (None, False),
    "metadata": (None, {}),
    "prompt_cache_retention": (None,),
    "safety_identifier": (None,),
}


class Unsupported(BaseModel):
    """OpenAI's fields kvd does not implement: refused unless they change nothing."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="after")
    def _refuse(self):
        for name in type(self).model_fields:
            if name in _NO_OP and getattr(self, name) not in _NO_OP[name]:
                raise FieldError(name, f"{name}: not supported by kvd (leave it out)")
        return self


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class Sampling(Unsupported):
    """What both completions take."""

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1, lt=2**31)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    user: str | None = None
    prompt_cache_key: str | None = None
    # kvd's own
    template: str | None = None
    top_k: int | None = Field(default=None, ge=0, lt=2**31)
    ignore_eos: bool = False
    # OpenAI's, not implemented: refused unless they change nothing
    n: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None
    service_tier: str | None = None
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    safety_identifier: Any = None
    prompt_cache_retention: Any = None

    @model_validator(mode="after")
    def _stream_options(self):
        if self.stream_options is not None and not self.stream:
            raise FieldError("stream_options", "stream_options: only allowed with stream: true")
        return self

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class ChatCompletionRequest(Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(default=None, ge=1, lt=2**31)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None
    modalities: list[str] | None = None
    audio: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None

    @model_validator(mode="after")
    def _chat_fields(self):
        if self.top_logprobs and not self.logprobs:
            raise FieldError("top_logprobs", "top_logprobs: needs logprobs: true")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise FieldError("max_completion_tokens", "max_completion_tokens: give it or max_tokens, not both")
        if not self.messages and self.template is None:
            raise FieldError("messages", "messages: empty (give messages, or a template alone)")
        return self

    def new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None

    @model_validator(mode="after")
    def _one_prompt(self):
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise FieldError("prompt", f"prompt: a batch of {len(prompt)} prompts; kvd takes one per request")
            self.prompt = prompt[0]
        return self

    def new_tokens(self) -> int | None:
        return self.max_tokens
