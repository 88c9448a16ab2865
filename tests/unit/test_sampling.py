"""Choosing tokens: greedy, seeded sampling, top-k/top-p, logprobs, validation."""

from __future__ import annotations

import math

import pytest
import torch

from inference.sampling import BatchedSampler, Sampler, SamplingParams, make_generator

SAMPLER = Sampler()


def test_greedy_is_argmax_and_reports_the_raw_logprob():
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.9], [3.0, 0.0, 0.0, 0.0]])
    out = SAMPLER.sample(logits, [SamplingParams(), SamplingParams(temperature=0.7, top_k=1)], [None, None])
    assert out.tokens == [1, 0]
    expected = torch.log_softmax(logits, dim=-1)
    assert out.logprobs == pytest.approx([expected[0, 1].item(), expected[1, 0].item()])


def test_a_seed_reproduces_the_draws_whatever_else_is_in_the_batch():
    torch.manual_seed(0)
    steps = [torch.randn(3, 50) for _ in range(20)]
    params = SamplingParams(temperature=1.0, seed=7)
    alone, together = make_generator(7), make_generator(7)
    other = make_generator(8)
    solo = [SAMPLER.sample(s[:1], [params], [alone]).tokens[0] for s in steps]
    batched = [
        SAMPLER.sample(s, [params, SamplingParams(), SamplingParams(temperature=1.0)], [together, None, other]).tokens[
            0
        ]
        for s in steps
    ]
    assert solo == batched
    different = make_generator(9)
    assert solo != [SAMPLER.sample(s[:1], [params], [different]).tokens[0] for s in steps]


def test_draws_follow_the_distribution():
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    logits = probs.log().unsqueeze(0)
    generator = make_generator(123)
    params = SamplingParams(temperature=1.0)
    counts = torch.zeros(4)
    draws = 4000
    for _ in range(draws):
        counts[SAMPLER.sample(logits, [params], [generator]).tokens[0]] += 1
    assert torch.allclose(counts / draws, probs, atol=0.03)


def test_top_k_and_top_p_cut_the_tail():
    logits = torch.tensor([[4.0, 3.0, 0.0, -1.0]])  # p ~ [0.70, 0.26, 0.013, 0.005]
    generator = make_generator(5)
    top_k = {
        SAMPLER.sample(logits, [SamplingParams(temperature=5.0, top_k=2)], [generator]).tokens[0] for _ in range(300)
    }
    assert top_k == {0, 1}
    top_p = {
        SAMPLER.sample(logits, [SamplingParams(temperature=1.0, top_p=0.5)], [generator]).tokens[0] for _ in range(100)
    }
    assert top_p == {0}


def test_top_logprobs_are_the_most_likely_tokens():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    out = SAMPLER.sample(logits, [SamplingParams(top_logprobs=3)], [None])
    ids, values = out.top[0]
    assert ids == [1, 3, 2]
    assert values == pytest.approx(torch.log_softmax(logits, -1)[0, [1, 3, 2]].tolist())


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"prompt_top_logprobs": 21}, "prompt_top_logprobs"),
        ({"prompt_logprobs_from": 0}, "prompt_logprobs_from"),
        ({"stop": ("",)}, "stop"),
        ({"top_logprobs": 21}, "top_logprobs"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_p": math.nan}, "min_p"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.01}, "frequency_penalty"),
        ({"frequency_penalty": math.inf}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": math.nan}, "repetition_penalty"),
        ({"logit_bias": {5: 100.5}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 65}, "min_tokens"),  # more than max_new_tokens (64)
    ],
)
def test_bad_parameters_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_edge_values_are_accepted_and_only_processors_set_the_flag():
    edges = SamplingParams(min_p=1.0, presence_penalty=-2.0, frequency_penalty=2.0, logit_bias={0: -100.0},
                           min_tokens=64, max_new_tokens=64)  # fmt: skip
    assert edges.processes_logits
    assert not SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.2, seed=1).processes_logits
    assert SamplingParams(repetition_penalty=1.1).processes_logits
    assert SamplingParams(min_tokens=1).processes_logits


# ------------------------------------------------- the batched (GPU) sampler, on CPU tensors

BATCHED = BatchedSampler()


def test_batched_greedy_logprobs_and_top_logprobs_equal_the_row_sampler():
    torch.manual_seed(1)
    logits = torch.randn(5, 300)
    params = [SamplingParams(), SamplingParams(top_logprobs=3, logprobs=True), SamplingParams(top_k=1, temperature=2.0),
              SamplingParams(top_logprobs=5), SamplingParams()]  # fmt: skip
    want = SAMPLER.sample(logits, params, [None] * 5)
    got = BATCHED.sample(logits, params, [None] * 5)
    assert got.tokens == want.tokens
    assert got.logprobs == want.logprobs  # the same float32 values
    assert got.top == want.top


def test_batched_seeded_draws_do_not_depend_on_the_batch():
    torch.manual_seed(0)
    steps = [torch.randn(4, 64) for _ in range(30)]
    params = SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=11)
    solo = make_generator(11)
    alone = [BATCHED.sample(s[1:2], [params], [solo]).tokens[0] for s in steps]
    gen = make_generator(11)
    others = [SamplingParams(temperature=1.0), SamplingParams(), SamplingParams(temperature=0.5, top_p=0.5)]
    together = [
        BATCHED.sample(
            s, [others[0], params, others[1], others[2]], [make_generator(1), gen, None, make_generator(2)]
        ).tokens[1]
        for s in steps
    ]
    assert alone == together
    assert len(set(alone)) > 3  # it does sample
    different = make_generator(12)
    assert alone != [BATCHED.sample(s[1:2], [params], [different]).tokens[0] for s in steps]


def test_batched_draws_follow_the_distribution_and_respect_top_k_top_p():
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    rows = 4000
    logits = probs.log().expand(rows, 4)
    generators = [make_generator(i) for i in range(rows)]
    out = BATCHED.sample(logits, [SamplingParams(temperature=1.0)] * rows, generators)
    counts = torch.bincount(torch.tensor(out.tokens), minlength=4).float()
    assert torch.allclose(counts / rows, probs, atol=0.03)
    tail = torch.tensor([[4.0, 3.0, 0.0, -1.0]]).expand(300, 4)  # p ~ [0.70, 0.26, 0.013, 0.005]
    top_k = BATCHED.sample(tail, [SamplingParams(temperature=5.0, top_k=2)] * 300, generators[:300])
    assert set(top_k.tokens) == {0, 1}
    top_p = BATCHED.sample(tail, [SamplingParams(temperature=1.0, top_p=0.5)] * 300, generators[:300])
    assert set(top_p.tokens) == {0}
