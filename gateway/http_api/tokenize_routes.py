"""vLLM's ``POST /tokenize`` and ``POST /detokenize``, with the gateway's own tokenizer.

``/tokenize`` takes a ``prompt`` (tokenized with the tokenizer's special
tokens unless ``add_special_tokens`` is false, as a completion's text prompt
is) or chat ``messages`` (rendered as a chat completion's are:
``add_generation_prompt``, ``continue_final_message``,
``chat_template_kwargs``), and answers ``{count, max_model_len, tokens}``
(``token_strs`` too with ``return_token_strs``); ``/detokenize`` takes
``tokens`` and answers ``{prompt}``. Both need a key with the ``generate``
scope; ``model``, when given, must be one of the model's names.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from pydantic import model_validator

from gateway.http_api.common import api_state, caller_key, on_thread
from gateway.http_api.models import served_model
from gateway.http_api.openai_schemas import Body, ChatMessage, TokenIds
from gateway.http_api.openai_translate import chat_prompt
from gateway.tenants import SCOPE_GENERATE
from kvd.common.field_error import FieldError

router = APIRouter()


class TokenizeRequest(Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool | None = None
    return_token_strs: bool | None = None

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise FieldError("prompt", "prompt, messages: give one of them")
        if self.messages is not None and not self.messages:
            raise FieldError("messages", "messages: empty")
        if self.messages is not None and self.add_special_tokens:
            raise FieldError("add_special_tokens", "add_special_tokens: not supported with messages")
        if self.continue_final_message and self.add_generation_prompt:
            raise FieldError("continue_final_message", "continue_final_message: give it or add_generation_prompt")
        return self


class DetokenizeRequest(Body):
    model: str | None = None
    tokens: TokenIds


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> dict:
    state, key = api_state(request), caller_key(request)

    def tokens() -> dict:
        state.requests.authorize(key, SCOPE_GENERATE)
        _, info = served_model(state, key, body.model)
        requests = state.requests
        if body.messages is not None:
            ids = requests.tokenize_chat(chat_prompt(body))
        else:
            ids = requests.tokenize_text(body.prompt, add_special_tokens=body.add_special_tokens is not False)
        reply = {"count": len(ids), "max_model_len": info.max_context, "tokens": ids, "token_strs": None}
        if body.return_token_strs:
            reply["token_strs"] = [requests.token_text(t) for t in ids]
        return reply

    return await on_thread(request, tokens)


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict:
    state, key = api_state(request), caller_key(request)

    def text() -> dict:
        state.requests.authorize(key, SCOPE_GENERATE)
        served_model(state, key, body.model)
        return {"prompt": state.requests.detokenize(body.tokens)}

    return await on_thread(request, text)
