"""What a request's sampling extras do to its logits before a token is chosen.

In vLLM's order, on the rows that ask for any of them:

    logit_bias          logit[t] += bias[t]
    min_tokens          logit[t] = -inf for EOS and stop token ids while the
                        output is shorter than min_tokens
    repetition_penalty  for t in the prompt or the output (CTRL, as in
                        transformers): logit > 0 ? logit / p : logit * p
    frequency_penalty,  logit[t] -= frequency_penalty * count[t]
    presence_penalty               + presence_penalty * (count[t] > 0)
                        (OpenAI's formula; count: t's occurrences in the output)
    constraint          logit[t] = -inf for each t the row's grammar does not
                        allow next (``inference.constraints``)

Greedy rows take the argmax of the result and draws start from it
(temperature, min_p, top_k, top_p: ``inference.sampling``); logprobs stay
those of the model's own distribution, computed before.

Rows that set none of them are not touched and cost nothing but one flag
read each (``SamplingParams.processes_logits``); the others are processed
together, a few tensor operations on the logits' device, with their token
ids copied there without waiting.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from inference.constraints import mask_logits
from inference.host_values import host_to, to_device

if TYPE_CHECKING:
    from inference.constraints import GrammarState
    from inference.sampling import SamplingParams


class TokenHistory(Protocol):
    """A row's tokens so far and, with a constraint, where they stand in its
    grammar (the engine passes its ``Sequence``)."""

    prompt_ids: list[int]
    output_ids: list[int]
    grammar: GrammarState | None


class _NoHistory:
    """A row without tokens (callers that pass no histories)."""

    prompt_ids: list[int] = []
    output_ids: list[int] = []
    grammar: GrammarState | None = None


NO_HISTORY = _NoHistory()


def process_logits(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    histories: Sequence[TokenHistory] | None,
    eos_token_ids: Collection[int],
) -> torch.Tensor:
    """The logits after each row's processors (see the module's docstring).

    Returns ``logits`` itself when no row has any to apply; otherwise a new
    tensor whose unprocessed rows are copies of the input's.
    """
    rows = [
        row
        for row, p in enumerate(params)
        if p.processes_logits and _applies(p, histories[row] if histories is not None else NO_HISTORY)
    ]
    if not rows:
        return logits
    picked = [params[row] for row in rows]
    picked_histories = [histories[row] if histories is not None else NO_HISTORY for row in rows]
    # Every row processed (a batch of constrained rows, say): one copy, no gather and scatter.
    index = None if len(rows) == logits.shape[0] else host_to(logits, rows, torch.long)
    processed = logits.clone() if index is None else logits.index_select(0, index)
    _add_bias(processed, picked)
    _mask_until_min_tokens(processed, picked, picked_histories, eos_token_ids)
    if any(p.penalizes for p in picked):
        processed = _penalize(processed, picked, picked_histories)
    mask_logits(processed, [h.grammar for h in picked_histories])
    return processed if index is None else logits.index_copy(0, index, processed)


def _applies(p: SamplingParams, history: TokenHistory) -> bool:
    """Whether any processor of ``p`` changes the row now (min_tokens stops
    mattering once the output is long enough)."""
    return bool(p.logit_bias) or p.penalizes or len(history.output_ids) < p.min_tokens or history.grammar is not None


def _add_bias(logits: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    vocab = logits.shape[1]
    rows, ids, biases = [], [], []
    for row, p in enumerate(params):
        for token, bias in p.logit_bias.items():
            if token < vocab:  # the service refuses others; a direct caller's are ignored
                rows.append(row)
                ids.append(token)
                biases.append(bias)
    if rows:
        logits.index_put_(
            (host_to(logits, rows, torch.long), host_to(logits, ids, torch.long)),
            host_to(logits, biases, logits.dtype),
            accumulate=True,
        )


def _mask_until_min_tokens(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    histories: Sequence[TokenHistory],
    eos_token_ids: Collection[int],
) -> None:
    """EOS and the stop token ids are impossible while the output is shorter
    than min_tokens. NOTE: EOS is masked even with ignore_eos, as vLLM does."""
    vocab = logits.shape[1]
    rows, ids = [], []
    for row, (p, history) in enumerate(zip(params, histories, strict=True)):
        if len(history.output_ids) < p.min_tokens:
            masked = {t for t in (*eos_token_ids, *p.stop_token_ids) if 0 <= t < vocab}
            rows += [row] * len(masked)
            ids += masked
    if rows:
        logits.index_put_((host_to(logits, rows, torch.long), host_to(logits, ids, torch.long)), _neg_inf(logits))


def _penalize(
    logits: torch.Tensor, params: Sequence[SamplingParams], histories: Sequence[TokenHistory]
) -> torch.Tensor:
    """The repetition, frequency and presence penalties (neutral for rows without them)."""
    counts = _counts(logits, [h.output_ids if p.penalizes else [] for p, h in zip(params, histories, strict=True)])
    seen = counts > 0
    if any(p.repetition_penalty != 1 for p in params):
        in_prompt = _counts(
            logits, [h.prompt_ids if p.repetition_penalty != 1 else [] for p, h in zip(params, histories, strict=True)]
        )
        repetition = host_to(logits, [p.repetition_penalty for p in params], logits.dtype)[:, None]
        repeated = torch.where(logits > 0, logits / repetition, logits * repetition)
        logits = torch.where(seen | (in_prompt > 0), repeated, logits)
    frequency = host_to(logits, [p.frequency_penalty for p in params], logits.dtype)[:, None]
    presence = host_to(logits, [p.presence_penalty for p in params], logits.dtype)[:, None]
    return logits - frequency * counts - presence * seen.to(logits.dtype)


def _counts(like: torch.Tensor, token_lists: Sequence[list[int]]) -> torch.Tensor:
    """Each row's occurrences of each token id, shaped like ``like``."""
    counts = torch.zeros_like(like)
    flat: list[int] = []
    for tokens in token_lists:
        flat += tokens
    if not flat:
        return counts
    lengths = torch.tensor([len(tokens) for tokens in token_lists])
    # NOTE: built on the host with its size known: repeat_interleave on a GPU
    # without output_size waits for the device.
    rows = torch.repeat_interleave(torch.arange(len(token_lists)), lengths, output_size=len(flat))
    rows, ids = to_device(like, rows), host_to(like, flat, torch.long)
    counts.index_put_((rows, ids), torch.ones((), dtype=like.dtype, device=like.device), accumulate=True)
    return counts


def _neg_inf(like: torch.Tensor) -> torch.Tensor:
    # NOTE: filled on the device: a scalar copied from the host could wait for it.
    return torch.full((), -math.inf, dtype=like.dtype, device=like.device)
