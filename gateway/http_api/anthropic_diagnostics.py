"""Anthropic's cache diagnostics: why this request could not reuse the prefix
of the one named by ``diagnostics.previous_message_id``.

Each ``/v1/messages`` request that asks for diagnostics is remembered under
its reply's id (the last ``MAX_RECORDS``, in this gateway's memory: a
gateway that restarted, or another gateway of the fleet, answers
``previous_message_not_found``, which says nothing about the prompt). The
reason compares the two requests as Anthropic's reasons do, in order:
``model_changed``, ``system_changed``, ``messages_changed`` (an earlier
message differs, rather than messages only being appended); none of them:
no reason (``null``). ``cache_missed_input_tokens`` is the previous prompt's
tokens past the prefix the two renderings share: what a cache holding the
previous prompt could not serve.

kvd's own token-level diagnosis (``gateway.cache_diagnosis``: the closest
earlier prompt of the tenant, the position and text where they part, the
cached prefix by tier) rides beside it as ``kvd_cache_diagnosis``.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from kvd_api.engine.v1 import engine_pb2 as epb

#: Requests remembered for later diagnostics (the oldest forgotten first).
MAX_RECORDS = 4096


@dataclass(frozen=True)
class PromptRecord:
    """What a later request is compared with."""

    tenant: str
    model: str
    chat: epb.ChatPrompt


class MessageRecords:
    """The last diagnosed requests by their reply's id. Thread-safe."""

    def __init__(self, capacity: int = MAX_RECORDS) -> None:
        self.capacity = capacity
        self._records: OrderedDict[str, PromptRecord] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, message_id: str, record: PromptRecord) -> None:
        with self._lock:
            self._records[message_id] = record
            while len(self._records) > self.capacity:
                self._records.popitem(last=False)

    def get(self, message_id: str) -> PromptRecord | None:
        with self._lock:
            return self._records.get(message_id)


def miss_reason(
    previous: PromptRecord | None, current: PromptRecord, token_ids: Callable[[epb.ChatPrompt], list[int]]
) -> dict | None:
    """Anthropic's ``cache_miss_reason`` for ``current`` after ``previous`` (None: nothing changed).

    Args:
        token_ids: a chat prompt's token ids, as the engines render it.
    """
    if previous is None or previous.tenant != current.tenant:  # another tenant's id is no id of this one's
        return {"type": "previous_message_not_found"}
    before, now = _split(previous.chat), _split(current.chat)
    if previous.model != current.model:
        kind = "model_changed"
    elif before[0] != now[0]:
        kind = "system_changed"
    elif before[1] != now[1][: len(before[1])]:
        kind = "messages_changed"
    else:
        return None
    old = token_ids(previous.chat)
    shared = 0 if kind == "model_changed" else _shared(old, token_ids(current.chat))
    return {"type": kind, "cache_missed_input_tokens": len(old) - shared}


def _split(chat: epb.ChatPrompt) -> tuple[str | None, list[tuple[str, str]]]:
    """(the system prompt, the other messages as (role, content))."""
    messages = [(m.role, m.content) for m in chat.messages]
    if messages and messages[0][0] == "system":
        return messages[0][1], messages[1:]
    return None, messages


def _shared(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)
