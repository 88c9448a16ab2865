"""Choosing the next token: greedy, or temperature / top-k / top-p with a seed."""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import torch

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
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")
        if any(not s for s in self.stop):
            raise ValueError("stop must not contain an empty string")

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
    """Picks one token per row of logits; each row has its own parameters."""

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
    ) -> Sampled:
        """Picks each row's token; log-probabilities are under the model's
        unmodified distribution."""
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
