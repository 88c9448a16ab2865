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
from gateway.tokenizer import GatewayTokenizer, Message, generation_prompt, messages_of
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
    ids = tokenizer.chat_ids(messages, add_generation_prompt=False)
    for follow_up in _FOLLOW_UPS:
        if tokenizer.chat_ids([*messages, *follow_up], add_generation_prompt=True)[: len(ids)] != ids:
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
        own = messages_of(request.chat) if kind == "chat" else []
        add_prompt = generation_prompt(request.chat) if kind == "chat" else True
        ids = tokenizer.chat_ids([*template.messages, *own], add_prompt)
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
    return TemplatedIds(template.token_ids + own_ids(tokenizer, request), len(template.token_ids))


def own_ids(tokenizer: GatewayTokenizer, request) -> list[int]:
    """The prompt's own tokens (may be empty: a template alone is a prompt)."""
    kind = request.WhichOneof("prompt")
    if kind == "token_ids":
        return list(request.token_ids.ids)
    if kind == "chat":
        return tokenizer.chat_ids(messages_of(request.chat), generation_prompt(request.chat))
    if kind == "text" and request.text:
        return tokenizer.text_ids(request.text)
    return []
