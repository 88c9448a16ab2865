"""Why a prompt missed the cache: where it diverged from the tenant's earlier prompts.

A prompt's cached prefix ends where it first differs from every prompt whose
blocks are still cached. The usual culprit is a token near the top that
changes per request (a timestamp, a request id, a reordered tool list), which
costs every block after it. ``PromptHistory`` keeps the last prompts the
gateway saw per cache salt and finds, for a new prompt, the earlier one it
shares the longest prefix with; ``diagnosis`` turns that, with the request's
``Usage``, into a ``CacheDiagnosis`` (the position, the two tokens there and
the text around them); ``record`` counts per-tenant hit rates and divergence
positions in Prometheus.

NOTE: the history is this gateway's own: a prompt served by another gateway
of the fleet, or before a restart, is not in it, and an earlier prompt in it
may since have been evicted from every tier. The divergence explains a miss
only when the cached prefix (``cached_tokens``) ends near it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
from google.protobuf import json_format
from prometheus_client import CollectorRegistry, Counter, Histogram

from kvd_api.daemon.v1 import daemon_pb2 as dpb
from kvd_api.gateway.v1 import gateway_pb2 as pb


class Divergence(NamedTuple):
    """Where a prompt first differs from the closest earlier prompt of its salt."""

    common_tokens: int  # the shared prefix's length: they differ at this position
    earlier: np.ndarray  # the earlier prompt's token ids (int32, read-only)


class PromptHistory:
    """The last prompts seen per cache salt. Thread-safe.

    Args:
        per_salt: prompts kept per salt (the newest).
        max_salts: salts kept (least recently used dropped first).

    NOTE: prompts of different salts never share cache blocks, so they are
    never compared. The salt is the tenant's, any per-request sub-salt
    included. Memory is at most ``max_salts * per_salt`` prompts of 4 bytes
    per token (the defaults and 8k-token prompts: 128 MiB).
    """

    def __init__(self, per_salt: int = 16, max_salts: int = 256) -> None:
        self.per_salt = per_salt
        self.max_salts = max_salts
        self._salts: OrderedDict[bytes, list[np.ndarray]] = OrderedDict()  # oldest prompt first
        self._lock = threading.Lock()

    def observe(self, salt: bytes, token_ids: Sequence[int]) -> Divergence | None:
        """Compares the prompt with the salt's earlier ones (None: there are none), then records it."""
        prompt = _frozen(token_ids)
        with self._lock:
            earlier = tuple(self._salts.get(salt, ()))
        found = _closest(prompt, earlier)
        if found is not None and found.common_tokens == len(prompt) == len(found.earlier):
            prompt = found.earlier  # the same prompt again: moved to newest, not kept twice
        self._record(salt, prompt)
        return found

    def __len__(self) -> int:
        """The prompts kept, all salts together."""
        with self._lock:
            return sum(map(len, self._salts.values()))

    def salts(self) -> int:
        with self._lock:
            return len(self._salts)

    def _record(self, salt: bytes, prompt: np.ndarray) -> None:
        with self._lock:
            kept = self._salts.setdefault(salt, [])
            self._salts.move_to_end(salt)
            # NOTE: by identity: only the array reused for an identical prompt
            # is dropped, never an equal one another thread recorded meanwhile.
            kept[:] = [p for p in kept if p is not prompt]
            kept.append(prompt)
            del kept[: -self.per_salt]
            while len(self._salts) > self.max_salts:
                self._salts.popitem(last=False)


def _frozen(token_ids: Sequence[int]) -> np.ndarray:
    prompt = np.array(token_ids, dtype=np.int32)  # a copy: the caller's list may change
    prompt.flags.writeable = False
    return prompt


def _closest(prompt: np.ndarray, earlier: Sequence[np.ndarray]) -> Divergence | None:
    """The earlier prompt sharing the longest prefix with ``prompt`` (ties: the most recent)."""
    best: Divergence | None = None
    for other in reversed(earlier):  # newest first: a tie keeps the most recent
        common = common_prefix(prompt, other)
        if best is None or common > best.common_tokens:
            best = Divergence(common, other)
    return best


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """The length of the prefix ``a`` and ``b`` share, compared in one vectorized pass."""
    n = min(len(a), len(b))
    mismatch = np.flatnonzero(a[:n] != b[:n])
    return int(mismatch[0]) if mismatch.size else n


# ------------------------------------------------------------ diagnosis


def diagnosis(
    token_ids: Sequence[int],
    divergence: Divergence | None,
    usage: pb.Usage,
    decode: Callable[[Sequence[int]], str],
    window: int = 8,
) -> pb.CacheDiagnosis:
    """The request's cached runs by tier and, with a divergence, where and how its prompt differed.

    Args:
        token_ids: the prompt as served (template tokens included).
        divergence: ``PromptHistory.observe``'s answer for it.
        usage: the finished request's.
        decode: token ids -> text (the gateway's tokenizer); given lists of ints.
        window: tokens decoded on each side of the divergence.

    NOTE: a window may start or end inside a character's bytes (byte-level
    BPE); ``decode`` shows those as it does any partial character.
    """
    d = pb.CacheDiagnosis(
        prompt_tokens=len(token_ids), cached_tokens=usage.cached_prompt_tokens, cached_runs=cached_runs(usage)
    )
    if divergence is None:
        return d
    at = divergence.common_tokens
    earlier = divergence.earlier
    d.has_earlier = True
    d.common_tokens = at
    d.token = _token_at(token_ids, at)
    d.earlier_token = _token_at(earlier, at)
    d.text_before = decode(_ids(token_ids, max(0, at - window), at))
    d.text_after = decode(_ids(token_ids, at, at + window))
    d.earlier_text_after = decode(_ids(earlier, at, at + window))
    return d


def as_json(d: pb.CacheDiagnosis) -> dict:
    """A diagnosis as the HTTP APIs show it: the proto's field names, every field, tiers by name."""
    return json_format.MessageToDict(d, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


def cached_runs(usage: pb.Usage) -> list[pb.CachedRun]:
    """The cached prefix by tier, in prompt order: device, then host, then disk (empty runs left out).

    NOTE: the daemon serves a prefix from the device up to its first block
    the device lost, then each block from the device if it is there, else
    from the host tier (which may have read it back from disk). ``Usage``
    has only each tier's total, so the runs lay the totals out in that
    order: exact when each tier's blocks are contiguous; a device block
    past the first host block is counted in the device run.
    """
    host_and_disk = usage.host_cached_prompt_tokens
    sizes = (
        (dpb.TIER_DEVICE, usage.cached_prompt_tokens - host_and_disk),
        (dpb.TIER_HOST, host_and_disk - usage.disk_cached_prompt_tokens),
        (dpb.TIER_DISK, usage.disk_cached_prompt_tokens),
    )
    runs, first = [], 0
    for tier, size in sizes:
        if size > 0:
            runs.append(pb.CachedRun(tier=tier, first_token=first, num_tokens=size))
            first += size
    return runs


def _token_at(ids: Sequence[int], at: int) -> int:
    return int(ids[at]) if at < len(ids) else -1


def _ids(ids: Sequence[int], start: int, stop: int) -> list[int]:
    """Python ints, whatever ``ids`` is: a tokenizer's decode may not take numpy's."""
    return [int(i) for i in ids[start:stop]]


# ------------------------------------------------------------ metrics

# NOTE: process-wide, as ``record`` is called from every request path; not in
# prometheus_client's default registry: ``register`` adds them to the registry
# ``GET /metrics`` serves (``HttpMetrics``), like the gateway's other metrics.
PROMPT_TOKENS = Counter(
    "kvd_gateway_prompt_tokens", "Prompt tokens of finished requests, by tenant", ["tenant"], registry=None
)
CACHED_PROMPT_TOKENS = Counter(
    "kvd_gateway_cached_prompt_tokens",
    "Of those, the tokens served by the cache (hit rate: over kvd_gateway_prompt_tokens)",
    ["tenant"],
    registry=None,
)
DIVERGED_AT = Histogram(
    "kvd_gateway_prompt_diverged_at_tokens",
    "Where prompts first differ from the tenant's closest earlier prompt (its length: identical)",
    ["tenant"],
    buckets=(0, 16, 64, 256, 512, 1024, 2048, 4096, 8192, 16384),
    registry=None,
)
_METRICS = (PROMPT_TOKENS, CACHED_PROMPT_TOKENS, DIVERGED_AT)


def register(registry: CollectorRegistry) -> None:
    """Adds the metrics to ``registry`` (each registry once)."""
    for metric in _METRICS:
        registry.register(metric)


def record(tenant: str, usage: pb.Usage, divergence: Divergence | None) -> None:
    """Counts a finished request's prompt and cached tokens, and where its prompt diverged."""
    PROMPT_TOKENS.labels(tenant).inc(usage.prompt_tokens)
    CACHED_PROMPT_TOKENS.labels(tenant).inc(usage.cached_prompt_tokens)
    if divergence is not None:
        DIVERGED_AT.labels(tenant).observe(divergence.common_tokens)
