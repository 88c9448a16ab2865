"""Choosing the next token: greedy, or temperature / top-k / top-p / min-p
with a seed, after the logit processors of ``inference.logit_processors``."""

from __future__ import annotations

import functools
import math
import secrets
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from inference.constraints import Constraint
from inference.host_values import host_to
from inference.logit_processors import TokenHistory, process_logits
from kvd.common.field_error import FieldError

MAX_TOP_LOGPROBS = 20
GREEDY_BELOW_TEMPERATURE = 1e-5
MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-MAX_PENALTY, MAX_PENALTY] (OpenAI's range)
MAX_LOGIT_BIAS = 100.0  # a logit bias lies in [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS] (OpenAI's range)


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens and when it stops.

    Attributes:
        temperature: 0 (or below 1e-5) picks the most likely token (greedy).
        top_k: keep only the k most likely tokens (0: all).
        top_p: keep the smallest set of likely tokens whose probability adds
            up to at least top_p (1: all).
        seed: makes sampling reproducible.
        max_new_tokens: the most tokens generated.
        stop_token_ids: tokens that end the output.
        stop: strings that end the output (not returned unless
            include_stop_str_in_output).
        ignore_eos: keep going past end-of-sequence tokens.
        logprobs: return each chosen token's log-probability.
        top_logprobs: also return this many most likely tokens (0-20) per step.
        min_p: keep only tokens at least min_p times as likely as the most
            likely one, after temperature (0: all).
        presence_penalty: subtracted from the logit of each token already in
            the output ([-2, 2]; 0: off).
        frequency_penalty: subtracted once per occurrence in the output
            ([-2, 2]; 0: off).
        repetition_penalty: divides the positive logits (multiplies the
            negative ones) of tokens in the prompt or the output (> 0; 1: off).
        logit_bias: token id -> added to its logit ([-100, 100]).
        min_tokens: no end-of-sequence, stop token or stop string before
            this many tokens (EOS and stop token ids are masked until then).
        include_stop_str_in_output: keep the stop string that ended the
            output in its text.
        prompt_logprobs: score the prompt: each prompt token's logprob
            given the tokens before it, from position ``prompt_logprobs_from``
            on (the cache serves only the blocks before it).
        prompt_top_logprobs: also this many most likely tokens (0-20) at
            each scored position.
        prompt_logprobs_from: the first prompt position scored (>= 1: the
            first token has no logprob).
        constraint: what the output must match (``inference.constraints``):
            the tokens its grammar does not allow next are masked, after
            the other processors.

    The processors (logit_bias, the min_tokens mask, the penalties) change
    greedy choices too; logprobs stay those of the model's own distribution.
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
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] = field(default_factory=dict, hash=False)
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    prompt_logprobs: bool = False
    prompt_top_logprobs: int = 0
    prompt_logprobs_from: int = 1
    constraint: Constraint | None = None

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise FieldError("temperature", f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise FieldError("top_k", f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise FieldError("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 0:
            raise FieldError("max_new_tokens", f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        for name in ("top_logprobs", "prompt_top_logprobs"):
            if not 0 <= (value := getattr(self, name)) <= MAX_TOP_LOGPROBS:
                raise FieldError(name, f"{name} must be in [0, {MAX_TOP_LOGPROBS}], got {value}")
        if self.prompt_logprobs_from < 1:
            raise FieldError(
                "prompt_logprobs_from", f"prompt_logprobs_from must be >= 1, got {self.prompt_logprobs_from}"
            )
        if any(not s for s in self.stop):
            raise FieldError("stop", "stop must not contain an empty string")
        self._check_processors()

    def _check_processors(self) -> None:
        if not 0 <= self.min_p <= 1:  # NaN fails too
            raise FieldError("min_p", f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise FieldError(name, f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise FieldError(
                "repetition_penalty", f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}"
            )
        for token, bias in self.logit_bias.items():
            if token < 0:
                raise FieldError("logit_bias", f"logit_bias: token id {token} is negative")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise FieldError(
                    "logit_bias",
                    f"logit_bias of token {token} must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {bias}",
                )
        if not 0 <= self.min_tokens <= self.max_new_tokens:
            raise FieldError(
                "min_tokens",
                f"min_tokens must be in [0, max_new_tokens ({self.max_new_tokens})], got {self.min_tokens}",
            )

    @property
    def greedy(self) -> bool:
        # NOTE: a temperature below 1e-5 is greedy, as in vLLM: dividing by
        # it would overflow float32 logits to inf (and a softmax to NaN).
        return self.temperature < GREEDY_BELOW_TEMPERATURE or self.top_k == 1

    @functools.cached_property
    def penalizes(self) -> bool:
        """Uses the prompt's or the output's tokens (a penalty is set)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1)

    @functools.cached_property
    def processes_logits(self) -> bool:
        """Some processor may change its logits (checked once per row and step;
        a request that sets none costs nothing)."""
        return bool(self.penalizes or self.logit_bias or self.min_tokens or self.constraint)


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


class Scored(NamedTuple):
    """Prompt tokens' logprobs, position by position."""

    logprobs: list[float]
    top: list[tuple[list[int], list[float]]] | None  # (token ids, logprobs) per position, when asked for


def score_tokens(logits: torch.Tensor, targets: Sequence[int], top_logprobs: int) -> Scored:
    """Each target's logprob under its row of ``logits`` (row i predicts
    target i), and the ``top_logprobs`` most likely tokens of each row, with
    one transfer to the host. The values are the same log-softmax a sampled
    token's logprob comes from, so a target that is its row's most likely
    token has exactly the top entry's logprob."""
    logprobs = torch.log_softmax(logits if logits.dtype == torch.float64 else logits.float(), dim=-1)
    index = torch.tensor(targets, dtype=torch.long).to(logits.device, non_blocking=True)
    host = _packed_to_host(logprobs, index, top_logprobs)
    chosen = [row[1] for row in host]
    if not top_logprobs:
        return Scored(chosen, None)
    return Scored(chosen, [_top(row, top_logprobs, top_logprobs) for row in host])


class Sampler:
    """Picks one token per row of logits; each row has its own parameters.

    Logits on a GPU go to :class:`BatchedSampler` (no per-row work on the
    device, one transfer back); on the CPU rows are drawn one by one.

    Args:
        eos_token_ids: the model's end-of-sequence ids (masked until a
            row's min_tokens).
    """

    def __init__(self, eos_token_ids: Collection[int] = ()) -> None:
        self.eos_token_ids = frozenset(eos_token_ids)
        self.batched = BatchedSampler(eos_token_ids)

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        histories: Sequence[TokenHistory] | None = None,
    ) -> Sampled:
        """Picks each row's token; log-probabilities are under the model's
        unmodified distribution.

        Args:
            histories: each row's tokens so far (its penalties and min_tokens
                read them); None: every row has none yet.
        """
        if logits.is_cuda:
            return self.batched.sample(logits, params, generators, histories)
        logits = logits if logits.dtype == torch.float64 else logits.float()
        logprobs = torch.log_softmax(logits, dim=-1)
        logits = process_logits(logits, params, histories, self.eos_token_ids)
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
    """One row's draw: temperature, min_p, top_k, top_p (vLLM's order)."""
    scaled = _finite_above(logits / p.temperature)
    if p.min_p:
        probs = torch.softmax(scaled, dim=-1)
        scaled = scaled.masked_fill(probs < p.min_p * probs.max(), -math.inf)
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
    stream as the CPU path's. The logit processors
    (``inference.logit_processors``) run on the device too, on their rows only.
    """

    def __init__(self, eos_token_ids: Collection[int] = ()) -> None:
        self.eos_token_ids = frozenset(eos_token_ids)

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        histories: Sequence[TokenHistory] | None = None,
    ) -> Sampled:
        logits = logits if logits.dtype == torch.float64 else logits.float()
        logprobs = torch.log_softmax(logits, dim=-1)
        logits = process_logits(logits, params, histories, self.eos_token_ids)
        tokens = logits.argmax(dim=-1)
        if not all(p.greedy for p in params):
            tokens = torch.where(
                self._host_to(logits, [not p.greedy for p in params]), self._draw(logits, params, generators), tokens
            )
        k = max(p.top_logprobs for p in params)
        host = _packed_to_host(logprobs, tokens, k)  # the one transfer (and the step's one wait)
        top = [_top(row, k, p.top_logprobs) for row, p in zip(host, params, strict=True)]
        return Sampled([int(row[0]) for row in host], [row[1] for row in host], top)

    def _draw(
        self, logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None]
    ) -> torch.Tensor:
        """Every row's draw under its temperature, min-p, top-k and top-p (greedy rows: ignored)."""
        vocab = logits.shape[1]
        temperature = self._host_to(logits, [p.temperature if not p.greedy else 1.0 for p in params])
        top_k = self._host_to(logits, [p.top_k or vocab for p in params])
        top_p = self._host_to(logits, [p.top_p for p in params])
        keys = self._host_to(logits, [0 if p.greedy else _next_key(g) for p, g in zip(params, generators, strict=True)])
        ordered, order = torch.sort(_finite_above(logits / temperature[:, None]), dim=-1, descending=True)
        if any(p.min_p and not p.greedy for p in params):
            ordered = self._min_p(ordered, params)
        rank = torch.arange(vocab, device=logits.device)
        probs = torch.softmax(ordered.masked_fill(rank[None, :] >= top_k[:, None], -math.inf), dim=-1)
        # Keep a token while the mass before it is below top_p (so the first always stays).
        probs = probs.masked_fill(torch.cumsum(probs, dim=-1) - probs >= top_p[:, None], 0.0)
        race = probs / -torch.log(_uniform(keys, order))
        return order.gather(1, race.argmax(dim=-1, keepdim=True)).squeeze(1)

    def _min_p(self, ordered: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
        """Drops the tokens less likely than min_p times the most likely one
        (``ordered``: each row's scaled logits, most likely first)."""
        min_p = self._host_to(ordered, [p.min_p for p in params]).to(ordered.dtype)
        probs = torch.softmax(ordered, dim=-1)
        return ordered.masked_fill(probs < min_p[:, None] * probs[:, :1], -math.inf)

    @staticmethod
    def _host_to(like: torch.Tensor, values: list) -> torch.Tensor:
        """A small per-row host list on ``like``'s device without a blocking copy."""
        return host_to(like, values)


_MASK32 = 0xFFFFFFFF


def _finite_above(scaled: torch.Tensor) -> torch.Tensor:
    """``scaled`` with +inf (a tiny temperature or repetition penalty
    overflowing float32) made the largest finite value: a softmax over it
    then splits between those tokens instead of turning NaN."""
    return scaled.clamp(max=torch.finfo(scaled.dtype).max)


def _packed_to_host(logprobs: torch.Tensor, tokens: torch.Tensor, k: int) -> list[list[float]]:
    """Each row's ``[token, its logprob, k most likely ids, their logprobs]``,
    packed on the device and copied to the host at once (ids are exact in
    the logprobs' float type: vocabularies stay below 2**24)."""
    columns = [tokens.to(logprobs.dtype)[:, None], logprobs.gather(1, tokens[:, None])]
    if k:
        values, ids = torch.topk(logprobs, k)
        columns += [ids.to(logprobs.dtype), values]
    return torch.cat(columns, dim=1).cpu().tolist()


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
