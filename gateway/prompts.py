"""A request's prompt as token ids: a template's tokens, then the prompt's own.

- A text template (created with ``content``) takes a text or token-id prompt,
  or none: its token ids followed by the prompt's own, tokenized separately so
  the template's cached blocks are reused exactly.
- A chat template (created with ``messages``) takes chat messages, or none:
  the template's messages and the request's are rendered together through
  the model's chat template, token for token what ``apply_chat_template``
  gives for them. Its stored tokens are its messages rendered alone, which
  ``template_ids`` checked, at creation, to begin such renderings.
- Any other pairing is an ``FieldError`` (INVALID_ARGUMENT) saying what to
  send: text glued in front of a rendered conversation is no chat prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from gateway.templates import Template
from gateway.tokenizer import GatewayTokenizer, Message, chat_of
from kvd.common.chat import generation_prompt
from kvd.common.field_error import FieldError

# Conversations a chat template's messages must begin, token for token.
_FOLLOW_UPS: tuple[tuple[Message, ...], ...] = (
    (("user", "Hello."),),
    (("user", "Hello."), ("assistant", "Hi! How can I help?"), ("user", "Tell me more.")),
)


def template_ids(tokenizer: GatewayTokenizer, content: str, messages: Sequence[Message]) -> list[int]:
    """A new template's token ids.

    Raises:
        FieldError: neither or both of content and messages; messages whose
            rendering changes when a conversation follows them (this model's
            chat template would not keep them as a prefix).
    """
    if content and messages:
        raise FieldError(None, "give the template's content or its messages, not both")
    if not content and not messages:
        raise FieldError("content", "content must not be empty (or give messages: a chat template)")
    if content:
        return tokenizer.text_ids(content)
    ids = tokenizer.chat_ids(chat_of(messages, add_generation_prompt=False))
    for follow_up in _FOLLOW_UPS:
        if tokenizer.chat_ids(chat_of([*messages, *follow_up], add_generation_prompt=True))[: len(ids)] != ids:
            raise FieldError(
                "messages",
                "messages: this model's chat template renders them differently once a conversation follows, "
                "so their tokens cannot be a cached prefix of chat requests; send the messages with each request",
            )
    return ids


class TemplatedIds(NamedTuple):
    """A templated request's prompt as token ids."""

    token_ids: list[int]
    template_tokens: int  # how many of them, first, are the template's (0: none reused)


def templated_ids(tokenizer: GatewayTokenizer, template: Template, request) -> TemplatedIds:
    """A templated request's token ids, the template's first."""
    kind = request.WhichOneof("prompt")
    if template.messages:
        if kind not in (None, "chat"):
            raise FieldError(
                "template",
                f"template {template.name!r} holds chat messages: send the prompt as chat messages (or none)",
            )
        prompt = chat_of(template.messages, add_generation_prompt=True)
        if kind == "chat":  # the request's messages after the template's, rendered as the request says
            prompt = chat_of(template.messages, generation_prompt(request.chat), like=request.chat)
            prompt.messages.extend(request.chat.messages)
        ids = tokenizer.chat_ids(prompt)
        # Creation checked that renderings keep the template's tokens first; one
        # that does not (a chat template reading later turns) is still the
        # right prompt, it just reuses no template block.
        count = len(template.token_ids)
        return TemplatedIds(ids, count if ids[:count] == template.token_ids else 0)
    if kind == "chat":
        raise FieldError(
            "template",
            f"template {template.name!r} holds text, not chat messages: a chat request needs a template "
            "created with messages (or send the prompt as text)",
        )
    own = own_ids(tokenizer, request, after_template=True)
    return TemplatedIds(template.token_ids + own, len(template.token_ids))


def own_ids(tokenizer: GatewayTokenizer, request, after_template: bool = False) -> list[int]:
    """The prompt's own tokens (may be empty: a template alone is a prompt).

    A text prompt gets the tokenizer's special tokens (a BOS) when it begins
    the prompt, none when it continues a template's tokens.
    """
    kind = request.WhichOneof("prompt")
    if kind == "token_ids":
        return list(request.token_ids.ids)
    if kind == "chat":
        return tokenizer.chat_ids(request.chat)
    if kind == "text" and request.text:
        return tokenizer.text_ids(request.text, add_special_tokens=not after_template)
    return []
