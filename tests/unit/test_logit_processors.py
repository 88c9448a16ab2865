"""The logit processors (logit_bias, min_tokens, the penalties) and min_p,
each checked against a plain implementation of its formula on the same
random logits (float64), through the row sampler and the batched one."""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass, field

import pytest
import torch

from inference.logit_processors import process_logits
from inference.sampling import BatchedSampler, Sampler, SamplingParams, make_generator

EOS = 3
VOCAB = 40
SAMPLERS = {"row": Sampler({EOS}), "batched": BatchedSampler({EOS})}


@dataclass
class History:
    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    grammar: None = None


def reference(logits: torch.Tensor, p: SamplingParams, history: History) -> torch.Tensor:
    """One row's processed logits, written out token by token (vLLM's order)."""
    x = [float(v) for v in logits]
    for token, bias in p.logit_bias.items():
        x[token] += bias
    if len(history.output_ids) < p.min_tokens:
        for token in {EOS, *p.stop_token_ids}:
            x[token] = -math.inf
    for token in set(history.prompt_ids) | set(history.output_ids):  # CTRL's repetition penalty
        x[token] = x[token] / p.repetition_penalty if x[token] > 0 else x[token] * p.repetition_penalty
    for token, count in Counter(history.output_ids).items():  # OpenAI's formula
        x[token] -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
    return torch.tensor(x, dtype=torch.float64)


def random_rows(rows: int, seed: int = 0) -> tuple[torch.Tensor, list[History]]:
    """Logits and histories whose tokens repeat (from a small range), so the penalties bite."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    logits = torch.randn(rows, VOCAB, dtype=torch.float64) * 3

    def tokens(most: int) -> list[int]:
        return [rng.randrange(12) for _ in range(rng.randrange(most))]

    return logits, [History([0, *tokens(8)], tokens(12)) for _ in range(rows)]


PROCESSORS = {
    "logit_bias": dict(logit_bias={5: 7.5, 9: -100.0, 30: 4.0}),
    "presence_penalty": dict(presence_penalty=1.7),
    "negative presence_penalty": dict(presence_penalty=-2.0),
    "frequency_penalty": dict(frequency_penalty=1.3),
    "repetition_penalty": dict(repetition_penalty=1.9),
    "repetition_penalty below 1": dict(repetition_penalty=0.4),
    "min_tokens": dict(min_tokens=6, stop_token_ids=(7, 8)),
    "all": dict(logit_bias={2: 3.0, 11: -2.5}, presence_penalty=0.6, frequency_penalty=-0.8, repetition_penalty=1.4,
                min_tokens=4, stop_token_ids=(1,)),
}  # fmt: skip


@pytest.mark.parametrize("kwargs", PROCESSORS.values(), ids=PROCESSORS.keys())
def test_processed_logits_equal_the_formula_and_other_rows_are_untouched(kwargs):
    logits, histories = random_rows(24)
    params = [SamplingParams(**kwargs) if row % 3 else SamplingParams() for row in range(24)]
    out = process_logits(logits, params, histories, {EOS})
    for row, (p, history) in enumerate(zip(params, histories, strict=True)):
        if p.processes_logits:
            assert torch.allclose(out[row], reference(logits[row], p, history), atol=1e-12, rtol=0)
        else:
            assert torch.equal(out[row], logits[row])


def test_rows_without_processors_cost_no_copy():
    logits, histories = random_rows(4)
    assert process_logits(logits, [SamplingParams(temperature=0.8, min_p=0.1)] * 4, histories, {EOS}) is logits
    done = SamplingParams(min_tokens=2)  # min_tokens no longer matters once the output is long enough
    assert process_logits(logits, [done] * 4, [History([1], [4, 5])] * 4, {EOS}) is logits


@pytest.mark.parametrize("sampler", SAMPLERS.values(), ids=SAMPLERS.keys())
@pytest.mark.parametrize("kwargs", PROCESSORS.values(), ids=PROCESSORS.keys())
def test_greedy_takes_the_argmax_of_the_processed_logits_and_reports_raw_logprobs(sampler, kwargs):
    logits, histories = random_rows(64, seed=1)
    params = [SamplingParams(**kwargs)] * 64
    out = sampler.sample(logits, params, [None] * 64, histories)
    want = [int(reference(logits[row], params[row], histories[row]).argmax()) for row in range(64)]
    assert out.tokens == want
    assert sum(a != b for a, b in zip(want, logits.argmax(-1).tolist(), strict=True)) > 0  # it did change some
    raw = torch.log_softmax(logits, -1)
    assert out.logprobs == pytest.approx([raw[row, token].item() for row, token in enumerate(want)], abs=1e-12)


@pytest.mark.parametrize("sampler", SAMPLERS.values(), ids=SAMPLERS.keys())
def test_draws_follow_the_processed_distribution(sampler):
    torch.manual_seed(2)
    logits = torch.randn(1, 6, dtype=torch.float64)
    history = History([0, 1], [1, 2, 2, 5])
    p = SamplingParams(temperature=1.0, logit_bias={4: 1.0}, presence_penalty=0.5, frequency_penalty=0.3,
                       repetition_penalty=1.3)  # fmt: skip
    want = torch.softmax(reference(logits[0], p, History([0, 1], [1, 2, 2, 5])), -1)
    draws = 4000
    if isinstance(sampler, BatchedSampler):
        out = sampler.sample(logits.expand(draws, 6), [p] * draws, [make_generator(i) for i in range(draws)],
                             [history] * draws).tokens  # fmt: skip
    else:
        generator = make_generator(3)
        out = [sampler.sample(logits, [p], [generator], [history]).tokens[0] for _ in range(draws)]
    counts = torch.bincount(torch.tensor(out), minlength=6).double()
    assert torch.allclose(counts / draws, want, atol=0.03)


@pytest.mark.parametrize("sampler", SAMPLERS.values(), ids=SAMPLERS.keys())
def test_min_tokens_masks_eos_and_stop_ids_exactly_until_the_count(sampler):
    logits = torch.zeros(1, VOCAB, dtype=torch.float64)
    logits[0, EOS], logits[0, 7], logits[0, 20] = 10.0, 9.0, 1.0  # EOS, then a stop id, then a plain token
    p = SamplingParams(min_tokens=3, stop_token_ids=(7,))
    chosen = [sampler.sample(logits, [p], [None], [History([1], [20] * n)]).tokens[0] for n in range(6)]
    assert chosen == [20, 20, 20, EOS, EOS, EOS]
    ignoring = SamplingParams(min_tokens=2, ignore_eos=True)  # masked regardless, as vLLM does
    assert sampler.sample(logits, [ignoring], [None], [History([1], [])]).tokens == [7]


@pytest.mark.parametrize("sampler", SAMPLERS.values(), ids=SAMPLERS.keys())
def test_min_p_keeps_the_tokens_at_least_min_p_times_the_top_one_after_temperature(sampler):
    logits = torch.tensor([[3.0, 2.6, 2.0, 1.0, 0.5, -1.0]], dtype=torch.float64)
    p = SamplingParams(temperature=0.7, min_p=0.3)
    probs = torch.softmax(logits[0] / 0.7, -1)
    kept = probs >= 0.3 * probs.max()
    want = torch.where(kept, probs, 0.0) / probs[kept].sum()
    assert 1 < int(kept.sum()) < 6
    draws = 3000
    if isinstance(sampler, BatchedSampler):
        out = sampler.sample(logits.expand(draws, 6), [p] * draws, [make_generator(i) for i in range(draws)]).tokens
    else:
        generator = make_generator(4)
        out = [sampler.sample(logits, [p], [generator]).tokens[0] for _ in range(draws)]
    counts = torch.bincount(torch.tensor(out), minlength=6).double()
    assert set(out) == set(torch.nonzero(kept).flatten().tolist())
    assert torch.allclose(counts / draws, want, atol=0.03)


@pytest.mark.parametrize("sampler", SAMPLERS.values(), ids=SAMPLERS.keys())
def test_a_seeded_row_with_processors_draws_the_same_whatever_shares_its_batch(sampler):
    torch.manual_seed(5)
    steps = [torch.randn(4, VOCAB, dtype=torch.float64) for _ in range(25)]
    p = SamplingParams(temperature=1.0, min_p=0.05, top_p=0.95, seed=21, presence_penalty=0.7, repetition_penalty=1.2,
                       logit_bias={3: 1.0})  # fmt: skip

    def run(batch_of) -> list[int]:
        generator, history, others = make_generator(21), History([1, 2, 3]), batch_of()
        for logits in steps:
            rows = [logits[i] for i in range(len(others) + 1)]
            params = [p] + [o[0] for o in others]
            out = sampler.sample(torch.stack(rows), params, [generator] + [o[1] for o in others],
                                 [history] + [o[2] for o in others])  # fmt: skip
            history.output_ids.append(out.tokens[0])
        return history.output_ids

    def others() -> list:
        return [
            (SamplingParams(), None, History([4])),
            (SamplingParams(temperature=0.9, frequency_penalty=1.0), make_generator(1), History([5], [6, 6])),
            (SamplingParams(min_tokens=3, logit_bias={9: 5.0}), None, History([7])),
        ]

    alone = run(list)
    crowded = run(others)
    assert alone == crowded
    assert len(set(alone)) > 3  # it does sample


@pytest.mark.parametrize("sampler", SAMPLERS.values(), ids=SAMPLERS.keys())
def test_extreme_values_never_break_a_step(sampler):
    """A temperature below 1e-5 is greedy (vLLM's rule); a tiny repetition
    penalty overflows float32 logits to inf, which must not turn a draw NaN."""
    torch.manual_seed(6)
    logits = torch.randn(2, VOCAB) * 3
    history = History([1, 2], [3])
    tiny_temperature = SamplingParams(temperature=1e-30, seed=1)
    out = sampler.sample(logits, [tiny_temperature] * 2, [make_generator(1), make_generator(2)], [history] * 2)
    assert out.tokens == logits.argmax(-1).tolist()
    tiny_penalty = SamplingParams(temperature=1.0, repetition_penalty=1e-45, min_p=0.5)
    out = sampler.sample(logits, [tiny_penalty] * 2, [make_generator(3), make_generator(4)], [history] * 2)
    boosted = [{t for t in (1, 2, 3) if logits[row, t] > 0} for row in range(2)]
    assert all(token in boosted[row] or not boosted[row] for row, token in enumerate(out.tokens))
