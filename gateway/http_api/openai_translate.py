"""The OpenAI surface: its requests as the gateway's ``GenerateRequest``, and its replies in OpenAI's shapes.

Replies: a whole completion (``completion_body``), and the chunks of a
streamed one (``Chunks``), for the chat (``chat.completion``) and the text
(``text_completion``) APIs alike. ``usage`` carries the cache's share of the
prompt as OpenAI reports it (``prompt_tokens_details.cached_tokens``: both
tiers), with kvd's breakdown beside it (``kvd``).
"""

from __future__ import annotations

import math
import secrets
import time
from collections.abc import Callable, Sequence

from gateway.http_api.openai_schemas import ChatCompletionRequest, CompletionRequest
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


def generate_request(body: ChatCompletionRequest | CompletionRequest) -> pb.GenerateRequest:
    """The gateway's request for an OpenAI request (FieldError: a value gRPC cannot carry)."""
    out = pb.GenerateRequest(template=body.template or "", cache_key=body.prompt_cache_key or "")
    if isinstance(body, ChatCompletionRequest):
        if body.messages:
            out.chat.messages.extend(epb.ChatMessage(role=_role(m.role), content=m.text()) for m in body.messages)
        if body.logprobs:
            out.sampling.logprobs = True
            out.sampling.top_logprobs = body.top_logprobs or 0
    else:
        if isinstance(body.prompt, str):
            out.text = body.prompt
        elif body.prompt:
            out.token_ids.ids.extend(body.prompt)
        elif not body.template:
            raise FieldError("prompt", "prompt: empty")
        if body.logprobs is not None:
            out.sampling.logprobs = True
            out.sampling.top_logprobs = body.logprobs
    sampling = out.sampling
    if (tokens := body.new_tokens()) is not None:
        sampling.max_new_tokens = tokens
    if body.temperature is not None:
        sampling.temperature = body.temperature
    if body.top_p is not None:
        sampling.top_p = body.top_p
    if body.top_k is not None:
        sampling.top_k = body.top_k
    if body.seed is not None:
        sampling.seed = body.seed % 2**64  # OpenAI's seeds are signed
    sampling.stop.extend(body.stops())
    sampling.ignore_eos = body.ignore_eos
    return out


def _role(role: str) -> str:
    return "system" if role == "developer" else role  # OpenAI's newer name for the system message


def usage(u: pb.Usage) -> dict:
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_prompt_tokens},
        "kvd": {
            "template_tokens": u.template_tokens,
            "host_cached_tokens": u.host_cached_prompt_tokens,
            "disk_cached_tokens": u.disk_cached_prompt_tokens,
            "time_to_first_token_s": u.time_to_first_token_s,
        },
    }


def completion_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)


def completion_body(
    reply: pb.GenerateResponse, chat: bool, model: str, want_logprobs: bool, token_text: TokenText
) -> dict:
    """A whole completion (``stream`` false)."""
    finish = FINISH.get(reply.finish_reason, "stop")
    logprobs = _logprobs(reply, chat, token_text, 0) if want_logprobs else None
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": reply.text}, "logprobs": logprobs,
                  "finish_reason": finish}  # fmt: skip
    else:
        choice = {"index": 0, "text": reply.text, "logprobs": logprobs, "finish_reason": finish}
    return {
        "id": completion_id(chat),
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": usage(reply.usage),
    }


class Chunks:
    """The chunks of one streamed completion, message by message."""

    def __init__(self, chat: bool, model: str, want_logprobs: bool, include_usage: bool, token_text: TokenText):
        self.chat = chat
        self.want_logprobs = want_logprobs
        self.include_usage = include_usage
        self.token_text = token_text
        self.text_offset = 0
        self.model = model
        self._id = completion_id(chat)
        self._object = "chat.completion.chunk" if chat else "text_completion"
        self._created = int(time.time())

    @property
    def _head(self) -> dict:
        return {"id": self._id, "object": self._object, "created": self._created, "model": self.model}

    def first(self) -> list[dict]:
        """A chat stream opens with the assistant's role."""
        if not self.chat:
            return []
        return [self._chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None})]  # fmt: skip

    def of(self, message: pb.GenerateResponse) -> list[dict]:
        """The chunks for one message of the gateway's stream (the last one brings the usage)."""
        out = []
        if message.text or message.token_ids:
            logprobs = _logprobs(message, self.chat, self.token_text, self.text_offset) if self.want_logprobs else None
            self.text_offset += len(message.text)
            if self.chat:
                choice = {"index": 0, "delta": {"content": message.text}, "logprobs": logprobs, "finish_reason": None}
            else:
                choice = {"index": 0, "text": message.text, "logprobs": logprobs, "finish_reason": None}
            out.append(self._chunk(choice))
        if message.HasField("usage"):
            finish = FINISH.get(message.finish_reason, "stop")
            if self.chat:
                choice = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": "", "logprobs": None, "finish_reason": finish}
            out.append(self._chunk(choice))
            if self.include_usage:
                out.append({**self._head, "choices": [], "usage": usage(message.usage)})
        return out

    def _chunk(self, choice: dict) -> dict:
        chunk = {**self._head, "choices": [choice]}
        if self.include_usage:
            chunk["usage"] = None  # OpenAI's chunks before the last carry a null usage
        return chunk


def _logprobs(message: pb.GenerateResponse, chat: bool, token_text: TokenText, text_offset: int) -> dict:
    ids = list(message.token_ids)
    tops: Sequence = message.top_logprobs if len(message.top_logprobs) == len(ids) else [None] * len(ids)
    if chat:
        steps = zip(ids, message.logprobs, tops, strict=False)  # logprobs: one per token when asked for
        entries = [_chat_entry(token_text, t, _finite(lp), top) for t, lp, top in steps]
        return {"content": entries}
    tokens = [token_text(t) for t in ids]
    offsets, at = [], text_offset
    for token in tokens:
        offsets.append(at)
        at += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [_finite(lp) for lp in message.logprobs],
        "top_logprobs": [_top_map(token_text, top) for top in tops] if any(t is not None for t in tops) else None,
        "text_offset": offsets,
    }


def _chat_entry(token_text: TokenText, token: int, logprob: float, top) -> dict:
    text = token_text(token)
    entry = {"token": text, "logprob": logprob, "bytes": list(text.encode()), "top_logprobs": []}
    if top is not None:
        entry["top_logprobs"] = [
            {"token": token_text(t), "logprob": _finite(lp), "bytes": list(token_text(t).encode())}
            for t, lp in zip(top.token_ids, top.logprobs, strict=True)
        ]
    return entry


def _top_map(token_text: TokenText, top) -> dict[str, float] | None:
    if top is None:
        return None
    return {token_text(t): _finite(lp) for t, lp in zip(top.token_ids, top.logprobs, strict=True)}


def _finite(logprob: float) -> float:
    """JSON has no -inf: a token that cannot be drawn gets OpenAI's stand-in for it."""
    return logprob if math.isfinite(logprob) else -9999.0
