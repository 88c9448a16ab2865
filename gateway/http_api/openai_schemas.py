"""The OpenAI surface's request bodies (pydantic), as OpenAI's API and vLLM's server name their fields.

Every field either works, changes nothing (and is accepted), or is refused:

- implemented: the sampling fields of OpenAI's chat and completions
  references and vLLM's extras (``top_k``, ``min_p``, penalties,
  ``logit_bias``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``,
  ``include_stop_str_in_output``), output constraints (``response_format``,
  vLLM's ``structured_outputs`` and ``guided_*``: ``openai_constraints``),
  ``tools``, ``tool_choice``, ``parallel_tool_calls``, assistant messages
  with ``tool_calls`` and ``tool`` messages, messages with ``name`` and text parts,
  ``add_generation_prompt``, ``continue_final_message``,
  ``chat_template_kwargs``, ``cache_control`` (on the request, a message or
  a text part: explicit caching, as Anthropic's), kvd's ``template`` and
  ``kvd_diagnose_cache``; on completions ``echo``
  (with ``logprobs``: the prompt's logprobs) and ``max_tokens`` 0 with it;
- accepted, changing nothing (``_NO_OP`` lists the values that do): ``user``,
  ``safety_identifier``, ``store``, ``metadata``, ``best_of`` of 1,
  and ``null`` for any field;
- refused with a 400 naming the field: a value of ``_NO_OP``'s fields that
  would change the reply (``best_of`` > 1, a chat's ``echo``, the legacy
  ``functions``...), as kvd would silently break its meaning;
- any other field is ignored: ``ignored_fields`` names it (the route logs
  it once and lists it in the ``x-kvd-ignored-fields`` header), as vLLM
  ignores fields it does not know.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from gateway.http_api.common import Int64
from gateway.http_api.openai_constraints import constraint_of
from kvd.common.field_error import FieldError
from kvd_api.engine.v1 import engine_pb2 as epb
from kvd_api.gateway.v1 import gateway_pb2 as pb

#: A completions request's prompts at most (each one is a generation).
MAX_PROMPTS = 1024
#: Choices per prompt at most (``n``): each is a generation of its own.
MAX_N = 128

# field -> the value(s) that change nothing; anything else is refused. None
# (null, or left out) is always one of them.
_NO_OP: dict[str, tuple] = {
    "best_of": (1,),
    "echo": (False,),
    "suffix": ("",),
    "prompt_logprobs": (),
    "functions": ([],),
    "function_call": ("none",),
    "modalities": (["text"],),
    "audio": (),
    "web_search_options": (),
    "verbosity": (),
    "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,),
    "use_beam_search": (False,),
    "length_penalty": (1, 1.0),
    "allowed_token_ids": (),
    "bad_words": ([],),
    "truncate_prompt_tokens": (),
    "chat_template": (),
    "documents": (),
}
_WHY = {
    "best_of": "one choice per prompt (best_of > 1 is not supported yet)",
    "echo": "echo is only supported on /v1/completions",
    "prompt_logprobs": "vLLM's prompt_logprobs is not supported; /v1/completions gives them with echo and logprobs",
    "functions": "the legacy functions API is not supported: give tools and tool_choice",
    "function_call": "the legacy functions API is not supported: give tools and tool_choice",
}


class Body(BaseModel):
    """A request body (or a part of one): fields it does not name are kept aside, to be reported as ignored."""

    model_config = ConfigDict(extra="allow")

    def ignored_fields(self, prefix: str = "") -> list[str]:
        """The names of the fields it ignored, its parts' too (``messages[].cache_control``)."""
        names = [prefix + name for name in self.model_extra or {}]
        for name in type(self).model_fields:
            value = getattr(self, name)
            parts = value if isinstance(value, list) else [value]
            for part in parts:
                if isinstance(part, Body):
                    names += part.ignored_fields(f"{prefix}{name}{'[]' if isinstance(value, list) else ''}.")
        return sorted(set(names))

    #: Fields of ``_NO_OP`` this body implements (any value works).
    _implemented: ClassVar[frozenset[str]] = frozenset()

    @model_validator(mode="after")
    def _refuse(self):
        for name in type(self).model_fields:
            value = getattr(self, name)
            if name in _NO_OP and name not in self._implemented and value is not None and value not in _NO_OP[name]:
                why = _WHY.get(name, "not supported by kvd (leave it out)")
                raise FieldError(name, f"{name}: {why}")
        return self


class StreamOptions(Body):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # OpenAI's padding of chunks: kvd adds none


_TTLS = {"5m": pb.CACHE_TTL_5M, "1h": pb.CACHE_TTL_1H}
#: How a message's text parts join into its content.
PART_JOINER = "\n"


class CacheControl(Body):
    """``{"type": "ephemeral", "ttl": "5m" | "1h"}`` (Anthropic's, and OpenAI-style
    gateways' on content parts): keep the prompt up to here cached (``gateway.cache_marks``)."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None

    def proto_ttl(self) -> pb.CacheTtl.ValueType:
        return _TTLS[self.ttl or "5m"]


class ContentPart(Body):
    type: Literal["text", "refusal"]
    text: str | None = None
    refusal: str | None = None
    cache_control: CacheControl | None = None

    def part_text(self) -> str:
        return (self.text if self.type == "text" else self.refusal) or ""


class CalledFunction(Body):
    name: str = Field(min_length=1)
    arguments: str = ""  # a JSON object, as JSON text


class ToolCall(Body):
    """A call an assistant's message made, sent back in the conversation."""

    id: str = ""
    type: Literal["function"] = "function"
    function: CalledFunction


class FunctionSpec(Body):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; none: any object
    strict: bool | None = None  # kvd always enforces a forced call's schema


class Tool(Body):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(Body):
    name: str = Field(min_length=1)


class NamedToolChoice(Body):
    type: Literal["function"]
    function: NamedFunction


class ChatMessage(Body):
    """A message; the fields an assistant's reply carries, sent back as the client got it, are accepted null."""

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None  # a tool message: the call it answers
    function_call: Any = None
    refusal: str | None = None
    audio: Any = None
    annotations: Any = None  # the reply's citations: nothing to render
    cache_control: CacheControl | None = None  # the prompt through this message

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts(cls, content):
        for part in content if isinstance(content, list) else ():
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("text", "refusal"):
                raise FieldError(
                    "messages", f"messages: a content part of type {kind!r}: only text parts are supported"
                )
        return content

    @model_validator(mode="after")
    def _plain_message(self):
        if self.role == "function":
            raise FieldError("messages", "messages: role 'function' (the legacy functions API): send a 'tool' message")
        if self.role not in ("system", "developer", "user", "assistant", "tool"):
            raise FieldError(
                "messages", f"messages: role {self.role!r}: give system, developer, user, assistant or tool"
            )
        if self.tool_calls and self.role != "assistant":
            raise FieldError("messages", f"messages: a {self.role} message with tool_calls (only an assistant's)")
        if self.role == "tool" and not self.tool_call_id:
            raise FieldError("messages", "messages: a tool message needs the tool_call_id of the call it answers")
        if self.function_call is not None:
            raise FieldError("messages", "messages: function_call (the legacy functions API): send tool_calls")
        if self.audio is not None:
            raise FieldError("messages", "messages: audio is not supported")
        return self

    def text(self) -> str:
        """The content as one text: its parts joined by newlines, as vLLM joins them."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return PART_JOINER.join(part.part_text() for part in self.content)


class Sampling(Body):
    """What both completions take (None everywhere: unset)."""

    model: str | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=0, lt=2**31)  # 0: completions with echo only
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1, lt=2**31)  # -1, 0: none (vLLM's -1)
    min_p: float | None = Field(default=None, ge=0, le=1)
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Int64] | None = None
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    repetition_penalty: float | None = Field(default=None, gt=0)
    logit_bias: dict[str, float] | None = None
    min_tokens: int | None = Field(default=None, ge=0, lt=2**31)
    ignore_eos: bool | None = None
    include_stop_str_in_output: bool | None = None
    prompt_cache_key: str | None = None
    n: int | None = Field(default=None, ge=1, le=MAX_N)  # choices per prompt: forks of one prefill
    # explicit caching: the whole prompt (a chat's: through its last message)
    cache_control: CacheControl | None = None
    # kvd's own
    template: str | None = None
    kvd_diagnose_cache: bool | None = None  # each choice says why its prompt missed the cache
    # accepted, changing nothing
    user: Any = None
    safety_identifier: Any = None
    prompt_cache_retention: Any = None
    service_tier: Any = None
    store: Any = None
    metadata: Any = None
    # refused unless they change nothing (_NO_OP)
    best_of: int | None = None
    prompt_logprobs: Any = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    use_beam_search: bool | None = None
    length_penalty: float | None = None
    allowed_token_ids: Any = None
    bad_words: Any = None
    truncate_prompt_tokens: Any = None
    # output constraints (openai_constraints)
    response_format: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None
    _constraint: epb.Constraint | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _sampling_fields(self):
        if self.stream_options is not None and not self.stream:
            raise FieldError("stream_options", "stream_options: only allowed with stream: true")
        for key in self.logit_bias or {}:
            if not key.strip().lstrip("-").isdigit():
                raise FieldError("logit_bias", f"logit_bias: key {key!r} is not a token id")
        # A malformed constraint field is refused with the body (whether it compiles: the engine's).
        self._constraint = constraint_of(self)
        return self

    @property
    def constraint(self) -> epb.Constraint | None:
        """The output constraint its fields name (``openai_constraints``; None: unconstrained)."""
        return self._constraint

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def forks(self) -> int:
        """Choices per prompt (``n``)."""
        return self.n or 1

    def include_usage(self) -> bool:
        return bool(self.stream_options is not None and self.stream_options.include_usage)


class ChatCompletionRequest(Sampling):
    messages: list[ChatMessage] = []
    max_completion_tokens: int | None = Field(default=None, ge=1, lt=2**31)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: Literal[False] | None = None  # a BOS on top of the template's: not supported
    tools: list[Tool] | None = None
    tool_choice: Any = None  # "none", "auto", "required" or a NamedToolChoice (checked below, one message for all)
    parallel_tool_calls: bool | None = None  # with tool_choice required: more than one call (default: yes)
    # accepted, changing nothing
    prediction: Any = None  # a latency hint: the reply is the same
    reasoning_effort: Any = None
    # refused unless they change nothing (_NO_OP)
    functions: list[Any] | None = None
    function_call: Any = None
    modalities: list[str] | None = None
    audio: Any = None
    web_search_options: Any = None
    verbosity: Any = None
    echo: bool | None = None  # completions only
    chat_template: Any = None
    documents: Any = None

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice(cls, value):
        if value is None or value in ("none", "auto", "required"):
            return value
        try:
            return NamedToolChoice.model_validate(value)
        except ValueError:
            raise FieldError(
                "tool_choice",
                'tool_choice: give "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
            ) from None

    @model_validator(mode="after")
    def _chat_fields(self):
        if self.top_logprobs and not self.logprobs:
            raise FieldError("top_logprobs", "top_logprobs: needs logprobs: true")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise FieldError("max_completion_tokens", "max_completion_tokens: give it or max_tokens, not both")
        if self.continue_final_message and self.add_generation_prompt:
            raise FieldError("continue_final_message", "continue_final_message: give it or add_generation_prompt")
        if not self.messages and self.template is None:
            raise FieldError("messages", "messages: empty (give messages, or a template alone)")
        if self.max_tokens == 0:
            raise FieldError("max_tokens", "max_tokens: must be >= 1")
        return self

    def new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


TokenIds = list[Annotated[int, Field(ge=-(2**63), lt=2**63)]]


class CompletionRequest(Sampling):
    prompt: str | TokenIds | list[str] | list[TokenIds]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    suffix: str | None = None
    add_special_tokens: bool | None = None  # a text prompt's BOS (default: yes, as vLLM)
    # The prompt before the completion (with logprobs: the prompt's tokens scored, the first one null).
    echo: bool | None = None

    _implemented: ClassVar[frozenset[str]] = frozenset({"echo"})

    @model_validator(mode="after")
    def _prompts(self):
        count = len(self.prompts())
        if count > MAX_PROMPTS:
            raise FieldError("prompt", f"prompt: {count} prompts; at most {MAX_PROMPTS} per request")
        if isinstance(self.prompt, list) and not self.prompt:
            raise FieldError("prompt", "prompt: empty")
        if self.max_tokens == 0 and not self.echo:
            raise FieldError("max_tokens", "max_tokens: 0 only with echo (the prompt alone)")
        if self.echo and self.template is not None:
            raise FieldError("echo", "echo: not with a template (echo the prompt without one)")
        return self

    @property
    def scores_prompt(self) -> bool:
        """The prompt's own tokens get logprobs (``echo`` with ``logprobs``)."""
        return bool(self.echo) and self.logprobs is not None

    def prompts(self) -> list[str | list[int]]:
        """Each prompt of the request (one choice each): a text or token ids."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]
        return list(prompt)

    def new_tokens(self) -> int | None:
        return self.max_tokens
