"""Explicit caching: a request's cache breakpoints as the daemon's cache marks,
and the usage they earn.

A breakpoint (``pb.CacheBreakpoint``: Anthropic's ``cache_control`` on a
block, or the whole prompt) says "keep the prompt up to here for a while".
The gateway turns each into a token count of the prompt it sends (a
``CacheMark``); the engine passes them to its daemon, which pins the
block-aligned prefix once it is computed, with an expiry, under the tenant's
pin quota (``--max-pinned-blocks``, counted per daemon) and its own pin cap.
Marking the same prefix again refreshes it. A breakpoint the daemon cannot
pin (quota, cap) costs the request nothing: it is served, and its usage
counts the breakpoint as unpinned.

Where a breakpoint on a chat message falls: its messages through the marked
one (that one's content cut after ``content_chars``) are rendered alone, and
the mark is the tokens that rendering shares with the whole prompt's. The
chat template's own text after a message (its end-of-turn tokens) belongs to
the mark when the whole message is marked; a chat template that renders an
earlier turn differently once more follow moves the mark back to where the
two agree, never past what the prompt really holds.

Usage (``creation_usage``): the tokens this request computed that its marks
now keep, the part of each mark past the cached prefix it was served and
past the marks before it, counted by the TTL of the mark that keeps them.
These are the daemon's counts (what it pinned, what it served from the
cache), block-aligned, never estimates.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import click

from kvd.common.cache_marks import MAX_MARKS, MAX_TTL_S
from kvd.common.config_fields import setting
from kvd.common.field_error import FieldError
from kvd_api.daemon.v1 import daemon_pb2 as dpb
from kvd_api.engine.v1 import engine_pb2 as epb
from kvd_api.gateway.v1 import gateway_pb2 as pb

_TTLS = "explicit caching (docs/caching.md)"
FIELD = "cache_breakpoints"


@dataclass(frozen=True)
class CacheTtls:
    """How long each kind of breakpoint keeps its prefix.

    Attributes:
        five_minutes_s: ``CACHE_TTL_5M``'s (Anthropic's default ``5m``).
        one_hour_s: ``CACHE_TTL_1H``'s (``1h``).
    """

    five_minutes_s: int = setting(
        "--cache-ttl-5m-s",
        env="KVD_CACHE_TTL_5M_S",
        type=click.IntRange(1, MAX_TTL_S),
        default=300,
        section=_TTLS,
        help="seconds a 5m cache breakpoint keeps its prefix pinned after its last use",
    )
    one_hour_s: int = setting(
        "--cache-ttl-1h-s",
        env="KVD_CACHE_TTL_1H_S",
        type=click.IntRange(1, MAX_TTL_S),
        default=3600,
        section=_TTLS,
        help="seconds a 1h cache breakpoint keeps its prefix pinned after its last use",
    )

    def seconds(self, ttl: pb.CacheTtl.ValueType) -> int:
        return self.one_hour_s if ttl == pb.CACHE_TTL_1H else self.five_minutes_s


#: A chat prompt's messages through index i, the last cut after n characters
#: (0: whole), as token ids rendered the way the request's prompt is.
PrefixIds = Callable[[int, int], list[int]]


def check_breakpoints(request: pb.GenerateRequest) -> None:
    """Raises FieldError naming ``cache_breakpoints[i]…`` for breakpoints that point nowhere."""
    breakpoints = request.cache_breakpoints
    if len(breakpoints) > MAX_MARKS:
        many = len(breakpoints)
        raise FieldError(FIELD, f"{FIELD}: at most {MAX_MARKS} cache breakpoints (cache_control marks), got {many}")
    kind = request.WhichOneof("prompt")
    for i, mark in enumerate(breakpoints):
        name = f"{FIELD}[{i}]"
        at = mark.WhichOneof("at")
        if at is None:
            raise FieldError(name, f"{name}: say where it is: message (a chat message's index) or prompt")
        if at == "prompt" and not mark.prompt:
            raise FieldError(f"{name}.prompt", f"{name}.prompt: true or left out (false marks nothing)")
        if at == "prompt" and mark.content_chars:
            raise FieldError(f"{name}.content_chars", f"{name}.content_chars: only with message")
        if at == "message":
            if kind != "chat":
                raise FieldError(f"{name}.message", f"{name}.message: only a chat prompt has messages")
            messages = request.chat.messages
            if not 0 <= mark.message < len(messages):
                raise FieldError(
                    f"{name}.message", f"{name}.message: {mark.message} is not an index of the {len(messages)} messages"
                )
            if not 0 <= mark.content_chars <= len(messages[mark.message].content):
                raise FieldError(
                    f"{name}.content_chars",
                    f"{name}.content_chars must be in [0, {len(messages[mark.message].content)}] "
                    f"(the message's length), got {mark.content_chars}",
                )
        if mark.ttl not in pb.CacheTtl.values():
            raise FieldError(f"{name}.ttl", f"{name}.ttl: unknown value {mark.ttl}")


@dataclass(frozen=True)
class PlacedMarks:
    """A request's breakpoints as the daemon's marks, and what their usage needs."""

    marks: dpb.CacheMarks
    one_hour: tuple[bool, ...]  # each mark's TTL kind, in mark order

    @property
    def empty(self) -> bool:
        return not self.marks.marks


def place(
    request: pb.GenerateRequest,
    token_ids: Sequence[int],
    prefix_ids: PrefixIds,
    block_size: int,
    ttls: CacheTtls,
    owner: str,
    owner_max_blocks: int,
) -> PlacedMarks:
    """The marks of a checked request's breakpoints, over its prompt ``token_ids``.

    Marks shorter than a block pin nothing and are left out; two breakpoints
    that land on the same token keep the longer TTL.
    """
    at: dict[int, bool] = {}  # num_tokens -> one hour
    for mark in request.cache_breakpoints:
        num_tokens = _position(mark, token_ids, prefix_ids)
        if num_tokens >= block_size:
            at[num_tokens] = at.get(num_tokens, False) or mark.ttl == pb.CACHE_TTL_1H
    positions = sorted(at)
    marks = dpb.CacheMarks(owner=owner, owner_max_blocks=owner_max_blocks)
    for num_tokens in positions:
        ttl = pb.CACHE_TTL_1H if at[num_tokens] else pb.CACHE_TTL_5M
        marks.marks.add(num_tokens=num_tokens, ttl_seconds=ttls.seconds(ttl))
    return PlacedMarks(marks, tuple(at[p] for p in positions))


def _position(mark: pb.CacheBreakpoint, token_ids: Sequence[int], prefix_ids: PrefixIds) -> int:
    if mark.WhichOneof("at") == "prompt":
        return len(token_ids)
    prefix = prefix_ids(mark.message, mark.content_chars)
    return _common_length(prefix, token_ids)


def _common_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def mark_parts(
    request: pb.GenerateRequest, message: int, ttls: Sequence[pb.CacheTtl.ValueType | None], lengths: Sequence[int],
    joiner: str,
) -> None:  # fmt: skip
    """Breakpoints for the marked parts of a message whose content is its
    parts' texts joined by ``joiner``: part i (``lengths[i]`` characters,
    marked when ``ttls[i]`` is set) keeps the content through it; the last
    part, the whole message (its end-of-turn tokens too)."""
    chars = 0
    for i, (ttl, length) in enumerate(zip(ttls, lengths, strict=True)):
        chars += length + (len(joiner) if i else 0)
        if ttl is None:
            continue
        whole = i == len(lengths) - 1
        if not whole and not chars:  # (content_chars 0 is the whole message)
            raise FieldError(FIELD, f"{FIELD}: a cache_control on empty text opening a message marks nothing")
        request.cache_breakpoints.add(message=message, content_chars=0 if whole else chars, ttl=ttl)


def chat_prefix(chat: epb.ChatPrompt, message: int, content_chars: int) -> epb.ChatPrompt:
    """``chat``'s messages through ``message`` (its content cut after
    ``content_chars``, 0: whole), rendered as ``chat`` is but with no
    generation prompt: what a breakpoint there keeps."""
    out = epb.ChatPrompt(add_generation_prompt=False)
    out.CopyFrom(chat)
    out.ClearField("messages")
    out.add_generation_prompt = False
    out.continue_final_message = bool(content_chars)  # a cut message renders open, as its tokens begin
    out.messages.extend(chat.messages[: message + 1])
    if content_chars:
        out.messages[-1].content = out.messages[-1].content[:content_chars]
    return out


def creation_usage(usage: pb.Usage, results: Sequence[dpb.MarkResult], placed: PlacedMarks) -> None:
    """Fills ``usage``'s cache creation counts from what the daemon did with
    each mark (``results``, any order) and its cached prefix."""
    by_tokens = {r.num_tokens: r for r in results}
    covered = usage.cached_prompt_tokens
    for mark, one_hour in zip(placed.marks.marks, placed.one_hour, strict=True):
        result = by_tokens.get(mark.num_tokens)
        if result is None or result.refused or not result.num_pinned_tokens:
            usage.unpinned_breakpoints += 1
            continue
        created = max(0, result.num_pinned_tokens - covered)
        covered = max(covered, result.num_pinned_tokens)
        usage.cache_creation_tokens += created
        if one_hour:
            usage.cache_creation_1h_tokens += created
        else:
            usage.cache_creation_5m_tokens += created


#: A request without breakpoints.
NO_MARKS = PlacedMarks(dpb.CacheMarks(), ())
