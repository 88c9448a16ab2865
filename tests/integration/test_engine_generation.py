"""The engine's greedy output equals transformers' `model.generate`, token for token.

float64 on both sides: summation-order differences between batched and
single-sequence execution are far below any logit gap there, so equality must
be exact.
"""

from __future__ import annotations

import concurrent.futures as cf

import torch

from inference import model_store
from tests.integration.engine_client import (
    assert_close_to_reference,
    generate,
    reference_generate,
    reference_greedy,
    request,
    stream_with_top5,
    stub,
)

NEW_TOKENS = 12


def prompts(tokenizer) -> list[list[int]]:
    """8 prompts; several share a long (multi-block) prefix."""
    document = (
        "The Rhine rises in the Swiss Alps, flows through Lake Constance, forms part of the border between "
        "Germany and France, and reaches the North Sea in the Netherlands. Its valley has been a trade route "
        "since Roman times, and many castles stand on the hills above it."
    )
    shared = tokenizer.encode(document, add_special_tokens=False)
    questions = [
        " Where does the river rise?",
        " Which sea does it reach?",
        " Name a lake it flows through.",
        " What stands on the hills?",
        " Since when is it a trade route?",
    ]
    others = [
        "Write a haiku about autumn leaves.",
        "List three prime numbers and explain why they are prime.",
        "What is the capital of Japan? Answer in one word.",
    ]
    return [shared + tokenizer.encode(q, add_special_tokens=False) for q in questions] + [
        tokenizer.encode(o, add_special_tokens=False) for o in others
    ]


def run_concurrently(address: str, token_lists: list[list[int]]):
    engine = stub(address)
    with cf.ThreadPoolExecutor(len(token_lists)) as pool:
        futures = [pool.submit(generate, engine, request(ids, NEW_TOKENS)) for ids in token_lists]
        return [f.result() for f in futures]


def test_concurrent_greedy_equals_generate_with_chunking_and_preemption(stack_factory, reference_model, tokenizer):
    token_lists = prompts(tokenizer)
    # A 48-token step budget chunks every prompt. All 8 sequences at once need
    # ~20 blocks of 16 tokens (shared prefix blocks counted once); the longest
    # needs 6. A pool of 12 holds each, never all: the daemon must preempt.
    engine = stack_factory(
        daemon_args=["--num-blocks", "12"], engine_args=["--dtype", "float64", "--token-budget", "48"]
    )
    results = run_concurrently(engine.address, token_lists)
    for ids, (tokens, _, final) in zip(token_lists, results, strict=True):
        assert tokens == reference_greedy(reference_model, ids, NEW_TOKENS)
        assert final.usage.prompt_tokens == len(ids) and final.usage.completion_tokens == NEW_TOKENS
    assert "preempted" in engine.log(), "the pool was meant to force preemption"


def test_a_shared_prefix_is_reported_cached_and_a_fully_cached_prompt_is_exact(
    stack_factory, reference_model, tokenizer
):
    engine = stack_factory(engine_args=["--dtype", "float64"])
    client = stub(engine.address)
    first_ids, second_ids = prompts(tokenizer)[:2]
    tokens, _, first = generate(client, request(first_ids, NEW_TOKENS))
    assert first.usage.cached_prompt_tokens == 0
    _, _, second = generate(client, request(second_ids, NEW_TOKENS))
    shared = next(i for i, (a, b) in enumerate(zip(first_ids, second_ids, strict=False)) if a != b)
    assert second.usage.cached_prompt_tokens >= shared // 16 * 16 > 0

    # A block-aligned prompt whose every block is cached computes only its last token.
    aligned = first_ids[: len(first_ids) // 16 * 16]
    generate(client, request(aligned, NEW_TOKENS))
    again, _, final = generate(client, request(aligned, NEW_TOKENS))
    assert final.usage.cached_prompt_tokens == len(aligned)
    assert again == reference_greedy(reference_model, aligned, NEW_TOKENS)


def test_without_prefix_caching_nothing_is_cached_and_the_tokens_are_the_same(stack_factory, tokenizer):
    engine = stack_factory(engine_args=["--dtype", "float64", "--no-prefix-caching"])
    client = stub(engine.address)
    ids = prompts(tokenizer)[0]
    first, _, _ = generate(client, request(ids, NEW_TOKENS))
    second, _, final = generate(client, request(ids, NEW_TOKENS))
    assert final.usage.cached_prompt_tokens == 0
    assert first == second


def test_float32_matches_generate_up_to_near_ties(stack_factory, tokenizer, model_dir):
    """float32, the serving default: identical up to the first divergence, where
    each side's token is among the other's five most likely."""
    reference = model_store.load_model(model_dir, torch.float32, "cpu")
    token_lists = prompts(tokenizer)
    engine = stack_factory(engine_args=["--dtype", "float32", "--token-budget", "64"])
    client = stub(engine.address)
    with cf.ThreadPoolExecutor(len(token_lists)) as pool:
        futures = [pool.submit(stream_with_top5, client, ids, NEW_TOKENS) for ids in token_lists]
        results = [f.result() for f in futures]
    identical = sum(
        assert_close_to_reference(*result, *reference_generate(reference, ids, NEW_TOKENS))
        for ids, result in zip(token_lists, results, strict=True)
    )
    # Any divergence is a near-tie; most prompts should not diverge at all.
    assert identical >= len(token_lists) // 2
