"""Choosing the next token: greedy, or temperature / top-k / top-p with a seed."""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvd.common.field_error import FieldError

MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens and when it stops.

    Attributes:
        temperature: 0 picks the most likely token (greedy).
        top_k: keep only the k most likely tokens (0: all).
        top_p: keep the smallest set of likely tokens whose probability adds
            up to at least top_p (1: all).
        seed: makes sampling reproducible.
        max_new_tokens: the most tokens generated.
        stop_token_ids: tokens that end the output.
        stop: strings that end the output (not returned).
        ignore_eos: keep going past end-of-sequence tokens.
        logprobs: return each chosen token's log-probability.
        top_logprobs: also return this many most likely tokens (0-20) per step.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_new_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise FieldError("temperature", f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise FieldError("top_k", f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise FieldError("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise FieldError("max_new_tokens", f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise FieldError(
                "top_logprobs", f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}"
            )
        if any(not s for s in self.stop):
            raise FieldError("stop", "stop must not contain an empty string")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


def make_generator(seed: int | None) -> torch.Generator:
    generator = torch.Generator()
    generator.manual_seed(secrets.randbits(63) if seed is None else seed)
    return generator


@dataclass(frozen=True)
class Sampled:
    """One step's choices, row by row."""

    tokens: list[int]
    logprobs: list[float]
    top: list[tuple[list[int], list[float]] | None]  # (token ids, logprobs) when asked for


class Sampler:
    """Picks one token per row of logits; each row has its own parameters.

    Logits on a GPU go to :class:`BatchedSampler` (no per-row work on the
    device, one transfer back); on the CPU rows are drawn one by one.
    """

    def __init__(self) -> None:
        self.batched = BatchedSampler()

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
    ) -> Sampled:
        """Picks each row's token; log-probabilities are under the model's
        unmodified distribution."""
        if logits.is_cuda:
            return self.batched.sample(logits, params, generators)
        logits = logits if logits.dtype == torch.float64 else logits.float()
        logprobs = torch.log_softmax(logits, dim=-1)
        tokens = logits.argmax(dim=-1)  # greedy rows keep this
        for row, p in enumerate(params):
            if not p.greedy:
                tokens[row] = _draw(logits[row], p, generators[row])
        chosen = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
        top: list[tuple[list[int], list[float]] | None] = [None] * len(params)
        for row, p in enumerate(params):
            if p.top_logprobs:
                values, ids = torch.topk(logprobs[row], p.top_logprobs)
                top[row] = (ids.tolist(), values.tolist())
        return Sampled(tokens.tolist(), chosen.tolist(), top)


def _draw(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> int:
    scaled = logits / p.temperature
    if p.top_k:
        kth = torch.topk(scaled, min(p.top_k, scaled.numel())).values[-1]
        scaled = scaled.masked_fill(scaled < kth, -math.inf)
    probs = torch.softmax(scaled, dim=-1)
    if p.top_p < 1:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Keep a token while the mass before it is below top_p (so the first always stays).
        drop = (torch.cumsum(sorted_probs, dim=-1) - sorted_probs) >= p.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
    # NOTE: the generator lives on the CPU, so draw there; one row is small.
    return int(torch.multinomial(probs.cpu(), 1, generator=generator).item())


class BatchedSampler:
    """Samples every row at once on the logits' device; all of a step's
    outputs (tokens, logprobs, top logprobs) reach the host in one transfer.

    Draws use the exponential race (the argmax of ``p / E`` with ``E ~ Exp(1)``
    picks a token with probability ``p``) with noise from a counter-based
    hash of (the row's key, the token id). A row's key is drawn from its
    request's CPU generator each step, so a seeded request gets the same
    tokens whatever else shares its batch, and nothing is drawn on the device
    from shared state. Greedy rows, logprobs and top logprobs equal
    :class:`Sampler`'s; seeded draws are reproducible but not the same
    stream as the CPU path's.
    """

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
    ) -> Sampled:
        logits = logits if logits.dtype == torch.float64 else logits.float()
        logprobs = torch.log_softmax(logits, dim=-1)
        tokens = logits.argmax(dim=-1)
        if not all(p.greedy for p in params):
            tokens = torch.where(
                self._host_to(logits, [not p.greedy for p in params]), self._draw(logits, params, generators), tokens
            )
        columns = [tokens.to(logits.dtype)[:, None], logprobs.gather(1, tokens[:, None])]
        k = max(p.top_logprobs for p in params)
        if k:
            values, ids = torch.topk(logprobs, k)
            columns += [ids.to(logits.dtype), values]
        host = torch.cat(columns, dim=1).cpu().tolist()  # the one transfer (and the step's one wait)
        top = [_top(row, k, p.top_logprobs) for row, p in zip(host, params, strict=True)]
        return Sampled([int(row[0]) for row in host], [row[1] for row in host], top)

    def _draw(
        self, logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None]
    ) -> torch.Tensor:
        """Every row's draw under its temperature, top-k and top-p (greedy rows: ignored)."""
        vocab = logits.shape[1]
        temperature = self._host_to(logits, [p.temperature if not p.greedy else 1.0 for p in params])
        top_k = self._host_to(logits, [p.top_k or vocab for p in params])
        top_p = self._host_to(logits, [p.top_p for p in params])
        keys = self._host_to(logits, [0 if p.greedy else _next_key(g) for p, g in zip(params, generators, strict=True)])
        ordered, order = torch.sort(logits / temperature[:, None], dim=-1, descending=True)
        rank = torch.arange(vocab, device=logits.device)
        probs = torch.softmax(ordered.masked_fill(rank[None, :] >= top_k[:, None], -math.inf), dim=-1)
        # Keep a token while the mass before it is below top_p (so the first always stays).
        probs = probs.masked_fill(torch.cumsum(probs, dim=-1) - probs >= top_p[:, None], 0.0)
        race = probs / -torch.log(_uniform(keys, order))
        return order.gather(1, race.argmax(dim=-1, keepdim=True)).squeeze(1)

    @staticmethod
    def _host_to(like: torch.Tensor, values: list) -> torch.Tensor:
        """A small per-row host list on ``like``'s device without a blocking copy."""
        host = torch.tensor(values)
        if like.is_cuda:
            return host.pin_memory().to(like.device, non_blocking=True)
        return host


_MASK32 = 0xFFFFFFFF


def _top(row: list[float], k: int, wanted: int) -> tuple[list[int], list[float]] | None:
    """A row's ``wanted`` top logprobs out of the packed ``[token, logprob, k ids, k values]``."""
    return ([int(i) for i in row[2 : 2 + wanted]], row[2 + k : 2 + k + wanted]) if wanted else None


def _next_key(generator: torch.Generator | None) -> int:
    """A 62-bit key from the request's generator (none: from torch's default one)."""
    return int(torch.randint(1 << 62, (1,), generator=generator).item())


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finaliser on int64 lanes holding 32-bit values."""
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & _MASK32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & _MASK32
    return x ^ (x >> 16)


def _uniform(keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Uniform noise in (0, 1), a function of (row key, token id) only."""
    low, high = (keys & _MASK32)[:, None], ((keys >> 32) & _MASK32)[:, None]
    x = _mix32((token_ids * 0x9E3779B1 + low) & _MASK32)
    x = _mix32(x ^ high)
    return (x.to(torch.float64) + 0.5) / 2.0**32
