"""A prompt as token ids, the one way the engine and the gateway both render it.

The engine tokenizes the prompts it is sent (``inference.service``) and the
gateway tokenizes the same prompts itself to hash their blocks and check its
chat templates (``gateway.tokenizer``): both call these functions, so the
gateway's hashes name exactly the blocks the engine computes.

- Text: ``tokenizer.encode(text)`` with the tokenizer's special tokens (a
  BOS where the model's tokenizer adds one), as vLLM tokenizes a
  completion's text prompt; a text that continues a template's tokens is
  tokenized without them (``add_special_tokens=False``).
- Chat: ``apply_chat_template`` over the messages (each one's ``name`` too,
  when it has one), with the prompt's ``add_generation_prompt`` (default on),
  ``continue_final_message`` and ``chat_template_kwargs``; nothing is added
  on top of what the template renders. A template that refuses the messages
  (roles that do not alternate, say: its ``raise_exception``) is the caller's
  error: ``FieldError`` naming ``chat.messages``.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from typing import Any

import jinja2
from google.protobuf import json_format

from kvd.common import tool_prompt
from kvd.common.field_error import FieldError
from kvd_api.engine.v1 import engine_pb2 as epb

MESSAGES = "chat.messages"
TOOLS = "chat.tools"
KWARGS = "chat.chat_template_kwargs"


def text_ids(tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    """``text``'s token ids, with the tokenizer's special tokens unless told otherwise."""
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


def chat_ids(tokenizer, chat: epb.ChatPrompt) -> list[int]:
    """``chat`` rendered with the model's chat template, as token ids.

    Raises:
        FieldError: no messages; kwargs that are ``apply_chat_template``'s own
            parameters; both ``add_generation_prompt`` and
            ``continue_final_message``; messages the template refuses.
    """
    if not chat.messages:
        raise FieldError(MESSAGES, f"{MESSAGES} is empty")
    kwargs = template_kwargs(chat)
    continue_final = chat.continue_final_message
    if continue_final and chat.HasField("add_generation_prompt") and chat.add_generation_prompt:
        raise FieldError(
            "chat.continue_final_message",
            "chat.continue_final_message: give it or add_generation_prompt, not both",
        )
    add_prompt = generation_prompt(chat)
    messages, tool_kwargs = rendered_messages(tokenizer, chat)
    try:
        encoded = tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=add_prompt,
            continue_final_message=continue_final,
            tokenize=True,
            **kwargs,
            **tool_kwargs,
        )
    except (jinja2.TemplateError, ValueError, TypeError, KeyError) as exc:
        # NOTE: a template's raise_exception ("Conversation roles must
        # alternate...") is the request's fault: INVALID_ARGUMENT, which a
        # client does not retry, not UNAVAILABLE.
        raise FieldError(MESSAGES, f"{MESSAGES}: the model's chat template refused them: {exc}") from exc
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


def generation_prompt(chat: epb.ChatPrompt) -> bool:
    """Whether to append the assistant header: unset means yes, unless the last message is continued."""
    if chat.HasField("add_generation_prompt"):
        return chat.add_generation_prompt
    return not chat.continue_final_message


def message_dicts(messages: Sequence[epb.ChatMessage]) -> list[dict[str, Any]]:
    """The messages as the chat template reads them (``name`` only where one is given)."""
    out = []
    for m in messages:
        entry = {"role": m.role, "content": m.content}
        if m.name:
            entry["name"] = m.name
        out.append(entry)
    return out


def rendered_messages(tokenizer, chat: epb.ChatPrompt) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages as the chat template reads them, and the template's
    ``tools`` argument: with tools, calls or results, as ``chat.tool_prompt``
    says (``kvd.common.tool_prompt``)."""
    uses_tools = bool(chat.tools) or any(m.tool_calls or m.tool_call_id or m.role == "tool" for m in chat.messages)
    if not uses_tools:
        return message_dicts(chat.messages), {}
    _check_tools(chat.tools)
    mode = chat.tool_prompt
    if mode == epb.TOOL_PROMPT_AUTO:
        mode = epb.TOOL_PROMPT_TEMPLATE if tool_prompt.template_knows_tools(tokenizer) else epb.TOOL_PROMPT_KVD
    plain = message_dicts(chat.messages)
    if mode == epb.TOOL_PROMPT_KVD:
        return tool_prompt.kvd_messages(chat.messages, plain, chat.tools), {}
    tools = [{"type": "function", "function": tool_prompt.function_dict(t)} for t in chat.tools]
    return tool_prompt.template_messages(chat.messages, plain), ({"tools": tools} if tools else {})


def _check_tools(tools: Sequence[epb.Tool]) -> None:
    names = set()
    for tool in tools:
        if not tool.name:
            raise FieldError(TOOLS, f"{TOOLS}: a tool has no name")
        if tool.name in names:
            raise FieldError(TOOLS, f"{TOOLS}: two tools are named {tool.name!r}")
        names.add(tool.name)
        try:
            schema = tool_prompt.parameters(tool)
        except ValueError as exc:
            raise FieldError(TOOLS, f"{TOOLS}: {tool.name}'s parameters are not JSON: {exc}") from None
        if not isinstance(schema, dict):
            raise FieldError(TOOLS, f"{TOOLS}: {tool.name}'s parameters are not a JSON schema (an object)")


def template_kwargs(chat: epb.ChatPrompt) -> dict[str, Any]:
    """The extra variables for the chat template; FieldError for one that is a parameter of the rendering itself."""
    if not chat.HasField("chat_template_kwargs"):
        return {}
    kwargs = json_format.MessageToDict(chat.chat_template_kwargs)
    reserved = sorted(set(kwargs) & _rendering_parameters())
    if reserved:
        raise FieldError(KWARGS, f"{KWARGS}: {', '.join(reserved)} cannot be set there")
    return kwargs


@functools.cache
def _rendering_parameters() -> frozenset[str]:
    """``apply_chat_template``'s own parameters: passed as template variables they would change the rendering."""
    from transformers import PreTrainedTokenizerBase  # heavy: only once a chat is rendered

    params = inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters
    return frozenset(name for name, p in params.items() if p.kind is not inspect.Parameter.VAR_KEYWORD) | {"messages"}
