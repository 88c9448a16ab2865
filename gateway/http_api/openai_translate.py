"""The OpenAI surface: its requests as the gateway's ``GenerateRequest``, and its replies in OpenAI's shapes.

Requests: a chat request is one ``GenerateRequest`` (``generate_request``), a
completions request one per prompt (``completion_requests``). The HTTP API's
defaults are set here, not the engine's: a chat without ``max_tokens`` runs
to the end of the context (``max_new_tokens_to_context``), a completion to
16 tokens (OpenAI's and vLLM's default), and each sampling field left unset
is the model's ``generation_config`` value, else OpenAI's (temperature 1).

Replies: a whole completion (``completion_body``), and the chunks of a
streamed one (``Chunks``), for the chat (``chat.completion``) and the text
(``text_completion``) APIs alike. ``usage`` carries the cache's share of the
prompt as OpenAI reports it (``prompt_tokens_details.cached_tokens``: both
tiers), with kvd's breakdown beside it (``kvd``).
"""

from __future__ import annotations

import json
import math
import secrets
import time
from collections.abc import Callable, Sequence

from gateway import cache_diagnosis
from gateway.cache_marks import mark_parts
from gateway.http_api.openai_schemas import (
    PART_JOINER,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    Sampling,
)
from kvd.common.field_error import FieldError
from kvd_api.engine.v1 import engine_pb2 as epb
from kvd_api.gateway.v1 import gateway_pb2 as pb

FINISH = {
    epb.FINISH_REASON_LENGTH: "length",
    epb.FINISH_REASON_STOP: "stop",
    epb.FINISH_REASON_EOS: "stop",
    epb.FINISH_REASON_CANCELLED: "stop",
}

#: token id -> its text (the gateway's tokenizer), for logprobs.
TokenText = Callable[[int], str]


#: A completion's new tokens when ``max_tokens`` is unset (OpenAI's and vLLM's
#: default for ``/v1/completions``; a chat runs to the end of the context instead).
COMPLETION_MAX_TOKENS = 16

#: The sampling fields the model's ``generation_config`` may set (the engine's ``Info.default_sampling``).
MODEL_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
#: OpenAI's temperature when neither the request nor the model sets one (top_p 1: none).
OPENAI_TEMPERATURE = 1.0


def generate_request(body: ChatCompletionRequest, defaults: epb.SamplingParams | None = None) -> pb.GenerateRequest:
    """The gateway's request for a chat request (FieldError: a value gRPC cannot carry).

    Args:
        defaults: the model's sampling defaults, for the fields the request leaves unset.
    """
    out = pb.GenerateRequest(template=body.template or "", cache_key=body.prompt_cache_key or "")
    if body.messages:
        out.chat.CopyFrom(chat_prompt(body))
    out.tool_choice.CopyFrom(tool_choice(body))
    if body.logprobs:
        out.sampling.logprobs = True
        out.sampling.top_logprobs = body.top_logprobs or 0
    _sampling(out.sampling, body, defaults)
    if body.new_tokens() is None:
        out.sampling.max_new_tokens_to_context = True  # OpenAI's chat: up to the end of the context
    _chat_breakpoints(out, body)
    out.diagnose_cache = bool(body.kvd_diagnose_cache)
    return out


def _chat_breakpoints(out: pb.GenerateRequest, body: ChatCompletionRequest) -> None:
    """``cache_control`` on text parts, messages and the request (through the last message)."""
    for i, message in enumerate(body.messages):
        if isinstance(message.content, list):
            ttls = [None if p.cache_control is None else p.cache_control.proto_ttl() for p in message.content]
            mark_parts(out, i, ttls, [len(p.part_text()) for p in message.content], PART_JOINER)
        if message.cache_control is not None:
            out.cache_breakpoints.add(message=i, ttl=message.cache_control.proto_ttl())
    if body.cache_control is not None:
        if body.messages:
            out.cache_breakpoints.add(message=len(body.messages) - 1, ttl=body.cache_control.proto_ttl())
        else:  # a template alone
            out.cache_breakpoints.add(prompt=True, ttl=body.cache_control.proto_ttl())


def completion_requests(
    body: CompletionRequest, defaults: epb.SamplingParams | None = None
) -> list[pb.GenerateRequest]:
    """The gateway's requests for a completions request, one per prompt, in order."""
    requests = []
    for prompt in body.prompts():
        out = pb.GenerateRequest(template=body.template or "", cache_key=body.prompt_cache_key or "")
        if isinstance(prompt, str):
            out.text = prompt
        elif prompt:
            out.token_ids.ids.extend(prompt)
        elif not body.template:
            raise FieldError("prompt", "prompt: empty")
        if body.logprobs is not None:
            out.sampling.logprobs = True
            out.sampling.top_logprobs = body.logprobs
        if body.scores_prompt:
            out.sampling.prompt_logprobs = True
            out.sampling.prompt_top_logprobs = body.logprobs or 0
        _sampling(out.sampling, body, defaults)
        if body.cache_control is not None:
            out.cache_breakpoints.add(prompt=True, ttl=body.cache_control.proto_ttl())
        out.diagnose_cache = bool(body.kvd_diagnose_cache)
        if body.max_tokens is None:
            out.sampling.max_new_tokens = COMPLETION_MAX_TOKENS
        requests.append(out)
    return requests


def chat_prompt(body) -> epb.ChatPrompt:
    """The messages of ``body`` (a chat completion's or a ``/tokenize`` request's) and how the chat
    template renders them (its ``add_generation_prompt``, ``continue_final_message``, ``chat_template_kwargs``)."""
    chat = epb.ChatPrompt(continue_final_message=bool(body.continue_final_message))
    chat.messages.extend(_message(m) for m in body.messages)
    for tool in getattr(body, "tools", None) or ():
        f = tool.function
        parameters = json.dumps(f.parameters) if f.parameters is not None else ""
        chat.tools.append(epb.Tool(name=f.name, description=f.description or "", parameters=parameters))
    if body.add_generation_prompt is not None:
        chat.add_generation_prompt = body.add_generation_prompt
    if body.chat_template_kwargs:
        try:
            chat.chat_template_kwargs.update(body.chat_template_kwargs)
        except (ValueError, TypeError) as exc:
            raise FieldError("chat_template_kwargs", f"chat_template_kwargs: {exc}") from exc
    return chat


def _message(m: ChatMessage) -> epb.ChatMessage:
    out = epb.ChatMessage(role=_role(m.role), content=m.text(), name=m.name or "", tool_call_id=m.tool_call_id or "")
    for call in m.tool_calls or ():
        out.tool_calls.append(epb.ToolCall(id=call.id, name=call.function.name, arguments=call.function.arguments))
    return out


def tool_choice(body: ChatCompletionRequest) -> pb.ToolChoice:
    """OpenAI's ``tool_choice`` and ``parallel_tool_calls`` (unset with tools: auto)."""
    choice = body.tool_choice
    parallel = body.parallel_tool_calls is not False
    if choice is None:
        return pb.ToolChoice()
    if isinstance(choice, str):
        return pb.ToolChoice(parallel=parallel, **{choice: True})
    return pb.ToolChoice(function=choice.function.name, parallel=parallel)


def _sampling(sampling: epb.SamplingParams, body: Sampling, defaults: epb.SamplingParams | None) -> None:
    """The sampling fields both completions share; the model's defaults (else OpenAI's) for those left unset."""
    if (tokens := body.new_tokens()) is not None:
        sampling.max_new_tokens = tokens
    for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
        if (value := getattr(body, name)) is not None:
            setattr(sampling, name, value)
    if body.top_k is not None:
        sampling.top_k = max(body.top_k, 0)  # vLLM's -1: no top-k
    model_defaults(sampling, defaults, OPENAI_TEMPERATURE)  # an unset temperature samples, as OpenAI's
    if body.seed is not None:
        sampling.seed = body.seed % 2**64  # OpenAI's seeds are signed
    sampling.stop.extend(body.stops())
    sampling.stop_token_ids.extend(body.stop_token_ids or ())
    sampling.ignore_eos = bool(body.ignore_eos)
    sampling.presence_penalty = body.presence_penalty or 0.0
    sampling.frequency_penalty = body.frequency_penalty or 0.0
    for key, bias in (body.logit_bias or {}).items():
        sampling.logit_bias[_token_id(key)] = bias
    sampling.min_tokens = body.min_tokens or 0
    sampling.include_stop_str_in_output = bool(body.include_stop_str_in_output)
    if body.constraint is not None:
        sampling.constraint.CopyFrom(body.constraint)


def model_defaults(sampling: epb.SamplingParams, defaults: epb.SamplingParams | None, temperature: float) -> None:
    """The model's defaults (``MODEL_DEFAULTS``) for the fields a body left
    unset, then ``temperature``, the API's own default, if still unset."""
    for name in MODEL_DEFAULTS:
        if not sampling.HasField(name) and defaults is not None and defaults.HasField(name):
            setattr(sampling, name, getattr(defaults, name))
    if not sampling.HasField("temperature"):
        sampling.temperature = temperature


def _token_id(key: str) -> int:
    token = int(key)
    if not -(2**63) <= token < 2**63:
        raise FieldError("logit_bias", f"logit_bias: key {key!r} is not a token id")
    return token


def _role(role: str) -> str:
    return "system" if role == "developer" else role  # OpenAI's newer name for the system message


def usage(u: pb.Usage) -> dict:
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {
            "cached_tokens": u.cached_prompt_tokens,
            # kvd's extension: what the request's cache_control marks wrote to the cache, by TTL
            "cache_creation_tokens": u.cache_creation_tokens,
            "cache_creation": {
                "ephemeral_5m_input_tokens": u.cache_creation_5m_tokens,
                "ephemeral_1h_input_tokens": u.cache_creation_1h_tokens,
            },
        },
        "kvd": {
            "template_tokens": u.template_tokens,
            "unpinned_breakpoints": u.unpinned_breakpoints,
            "host_cached_tokens": u.host_cached_prompt_tokens,
            "disk_cached_tokens": u.disk_cached_prompt_tokens,
            "time_to_first_token_s": u.time_to_first_token_s,
        },
    }


def completion_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)


def summed_usage(usages: Sequence[pb.Usage], forks: int = 1) -> pb.Usage:
    """The usage of several generations, in choice order: completion tokens
    summed over all; the prompt's counts once per prompt (its first fork's:
    ``forks`` choices share each prompt, as OpenAI and vLLM count ``n``); the
    latest first token."""
    total = pb.Usage()
    for index, u in enumerate(usages):
        fields = _COUNTS if index % forks == 0 else ("completion_tokens",)
        for field in fields:
            setattr(total, field, getattr(total, field) + getattr(u, field))
        total.time_to_first_token_s = max(total.time_to_first_token_s, u.time_to_first_token_s)
    return total


_COUNTS = tuple(f.name for f in pb.Usage.DESCRIPTOR.fields if f.name != "time_to_first_token_s")


def completion_body(
    replies: Sequence[pb.GenerateResponse],
    chat: bool,
    model: str,
    want_logprobs: bool,
    token_text: TokenText,
    forks: int = 1,
    echoes: Sequence[str] | None = None,
) -> dict:
    """A whole completion (``stream`` false): one choice per reply, in order.

    Args:
        echoes: each prompt's text, put before its choices' (``echo``; with
            logprobs, its tokens' logprobs from the replies' ``prompt_logprobs``).
    """
    choices = []
    for index, reply in enumerate(replies):
        finish = finish_reason(reply)
        if chat:
            logprobs = _logprobs(reply, chat, token_text, 0) if want_logprobs else None
            message: dict = {"role": "assistant", "content": reply.text}
            if reply.tool_calls:
                message["content"] = reply.text or None  # OpenAI's: null beside calls, unless the model said more
                message["tool_calls"] = [_call(call) for call in reply.tool_calls]
            choices.append({"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish,
                            **_diagnosis(reply)})  # fmt: skip
            continue
        echo = echoes[index // forks] if echoes is not None else ""
        logprobs = None
        if want_logprobs:
            logprobs = _logprobs(reply, chat, token_text, len(echo))
            if reply.HasField("prompt_logprobs"):
                logprobs = _joined(_scored_prompt(reply.prompt_logprobs, token_text), logprobs)
        choices.append({"index": index, "text": echo + reply.text, "logprobs": logprobs, "finish_reason": finish,
                        **_diagnosis(reply)})  # fmt: skip
    return {
        "id": completion_id(chat),
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage(summed_usage([r.usage for r in replies], forks)),
    }


class Chunks:
    """The chunks of one streamed completion, message by message; with several
    prompts, each message is its choice's (``index``), and the usage (summed)
    comes once every choice finished."""

    def __init__(
        self,
        chat: bool,
        model: str,
        want_logprobs: bool,
        include_usage: bool,
        token_text: TokenText,
        choices: int = 1,
        forks: int = 1,
    ):
        #: each prompt's text, streamed before its choices' (completions' ``echo``); set once known
        self.echoes: Sequence[str] | None = None
        self.chat = chat
        self.want_logprobs = want_logprobs
        self.include_usage = include_usage
        self.token_text = token_text
        self.model = model
        self._text_offsets = [0] * choices
        self._usages: list[pb.Usage | None] = [None] * choices  # each choice's, once it finished
        self._finished = 0
        self._forks = forks
        self._id = completion_id(chat)
        self._object = "chat.completion.chunk" if chat else "text_completion"
        self._created = int(time.time())

    @property
    def _head(self) -> dict:
        return {"id": self._id, "object": self._object, "created": self._created, "model": self.model}

    def first(self) -> list[dict]:
        """A chat stream opens with the assistant's role (each choice's); an
        echoed completion with its prompt, unless its logprobs bring it (``of``)."""
        if not self.chat:
            if self.echoes is None or self.want_logprobs:
                return []
            return [self._echo(index, None) for index in range(len(self._usages))]
        return [self._chunk({"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}) for index in range(len(self._usages))]  # fmt: skip

    def of(self, message: pb.GenerateResponse, index: int = 0) -> list[dict]:
        """The chunks for one message of choice ``index``'s stream (its last one brings its usage)."""
        out = []
        if message.HasField("prompt_logprobs") and self.echoes is not None and self.want_logprobs:
            out.append(self._echo(index, _scored_prompt(message.prompt_logprobs, self.token_text)))
        if message.text or message.token_ids:
            offset = self._text_offsets[index]
            logprobs = _logprobs(message, self.chat, self.token_text, offset) if self.want_logprobs else None
            self._text_offsets[index] += len(message.text)
            if self.chat:
                choice = {"index": index, "delta": {"content": message.text}, "logprobs": logprobs,
                          "finish_reason": None}  # fmt: skip
            else:
                choice = {"index": index, "text": message.text, "logprobs": logprobs, "finish_reason": None}
            out.append(self._chunk(choice))
        if message.tool_calls:  # each call whole, in one delta (OpenAI's clients join the deltas by index)
            calls = [{"index": i, **_call(call)} for i, call in enumerate(message.tool_calls)]
            out.append(self._chunk({"index": index, "delta": {"tool_calls": calls}, "logprobs": None,
                                    "finish_reason": None}))  # fmt: skip
        if message.HasField("usage"):
            finish = finish_reason(message)
            if self.chat:
                choice = {"index": index, "delta": {}, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": index, "text": "", "logprobs": None, "finish_reason": finish}
            out.append(self._chunk({**choice, **_diagnosis(message)}))
            self._usages[index] = message.usage
            self._finished += 1
            if self.include_usage and self._finished == len(self._usages):
                out.append({**self._head, "choices": [], "usage": usage(summed_usage(self._usages, self._forks))})
        return out

    def _echo(self, index: int, logprobs: dict | None) -> dict:
        """The chunk of choice ``index``'s echoed prompt."""
        assert self.echoes is not None
        text = self.echoes[index // self._forks]
        self._text_offsets[index] += len(text)
        return self._chunk({"index": index, "text": text, "logprobs": logprobs, "finish_reason": None})

    def _chunk(self, choice: dict) -> dict:
        chunk = {**self._head, "choices": [choice]}
        if self.include_usage:
            chunk["usage"] = None  # OpenAI's chunks before the last carry a null usage
        return chunk


def _diagnosis(reply: pb.GenerateResponse) -> dict:
    """A choice's ``kvd_cache_diagnosis`` when its request asked for one (``kvd_diagnose_cache``)."""
    if not reply.HasField("cache_diagnosis"):
        return {}
    return {"kvd_cache_diagnosis": cache_diagnosis.as_json(reply.cache_diagnosis)}


def finish_reason(reply: pb.GenerateResponse) -> str:
    """OpenAI's finish reason: ``tool_calls`` when the reply made calls."""
    return "tool_calls" if reply.tool_calls else FINISH.get(reply.finish_reason, "stop")


def _call(call: epb.ToolCall) -> dict:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def _logprobs(message: pb.GenerateResponse, chat: bool, token_text: TokenText, text_offset: int) -> dict:
    ids = list(message.token_ids)
    tops: Sequence = message.top_logprobs if len(message.top_logprobs) == len(ids) else [None] * len(ids)
    if chat:
        steps = zip(ids, message.logprobs, tops, strict=False)  # logprobs: one per token when asked for
        entries = [_chat_entry(token_text, t, _finite(lp), top) for t, lp, top in steps]
        return {"content": entries}
    return _text_logprobs(token_text, ids, message.logprobs, tops, text_offset)


def _text_logprobs(
    token_text: TokenText, ids: Sequence[int], logprobs: Sequence[float | None], tops: Sequence, text_offset: int
) -> dict:
    """Completions' logprobs of ``ids``: each token's text, logprob (None:
    none, the prompt's first), most likely tokens with the token itself among
    them (as OpenAI's: up to logprobs + 1), and offset in the choice's text."""
    tokens = [token_text(t) for t in ids]
    offsets, at = [], text_offset
    for token in tokens:
        offsets.append(at)
        at += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [None if lp is None else _finite(lp) for lp in logprobs],
        "top_logprobs": [
            None if lp is None else {**_top_map(token_text, top), text: _finite(lp)}
            for text, lp, top in zip(tokens, logprobs, tops, strict=True)
        ],
        "text_offset": offsets,
    }


def _scored_prompt(scored: epb.PromptLogprobs, token_text: TokenText) -> dict:
    """An echoed prompt's logprobs (the positions before the first scored one: None)."""
    first = scored.first_position
    wanted = len(scored.logprobs)
    tops = scored.top_logprobs if len(scored.top_logprobs) == wanted else [None] * wanted
    logprobs: list[float | None] = [None] * first + list(scored.logprobs)
    return _text_logprobs(token_text, scored.token_ids, logprobs, [None] * first + list(tops), 0)


def _joined(prompt: dict, output: dict) -> dict:
    """An echoed prompt's logprobs followed by its completion's."""
    return {key: prompt[key] + output[key] for key in prompt}


def _chat_entry(token_text: TokenText, token: int, logprob: float, top) -> dict:
    text = token_text(token)
    entry = {"token": text, "logprob": logprob, "bytes": list(text.encode()), "top_logprobs": []}
    if top is not None:
        entry["top_logprobs"] = [
            {"token": token_text(t), "logprob": _finite(lp), "bytes": list(token_text(t).encode())}
            for t, lp in zip(top.token_ids, top.logprobs, strict=True)
        ]
    return entry


def _top_map(token_text: TokenText, top) -> dict[str, float]:
    if top is None:
        return {}
    return {token_text(t): _finite(lp) for t, lp in zip(top.token_ids, top.logprobs, strict=True)}


def _finite(logprob: float) -> float:
    """JSON has no -inf: a token that cannot be drawn gets OpenAI's stand-in for it."""
    return logprob if math.isfinite(logprob) else -9999.0
