"""The family matrix: each architecture the engine serves, token-exact against
transformers' `model.generate`, or refused at start.

Per family (tests/model_families.py, a tiny random-weight float64 model): a
real daemon and a real engine, both in this process on real sockets (the
daemon's cache is made for each model's layout), serve concurrent prompts
longer than the sliding window, sharing a prefix (cache hits), prefilled in
chunks shorter than the prompts, on a pool too small to hold them all
(preemption). Every greedy token must equal `generate`'s, and a cache hit's
logprobs the reference logits' (the family's own head and logit transforms).

    pytest tests/integration/test_model_families.py --families gemma2,qwen3   # a subset
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import os
import random
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from inference.app import EngineApp
from inference.config import EngineSettings
from inference.model_support import VERIFIED_FAMILIES
from kvd.common.grpc_server import Server
from kvd.daemon import Daemon, DaemonConfig
from kvd.service import build_server
from kvd_api.engine.v1 import engine_pb2 as pb
from tests.conftest import wait_serving
from tests.integration.engine_client import generate, reference_greedy, request, stub
from tests.model_families import FAMILIES, TOKEN_BUDGET, VOCAB, WINDOW, build

NEW_TOKENS = 8
BLOCK_SIZE = 8
NUM_BLOCKS = 16  # holds any one sequence (at most 9 blocks), never all six at once


def prompts(seed: int) -> list[list[int]]:
    """Six prompts of 44-60 tokens (windows are 20): four share a 4-block prefix."""
    rng = random.Random(seed)
    words = lambda n: [rng.randrange(3, VOCAB) for _ in range(n)]  # noqa: E731 (no BOS/EOS/pad ids)
    shared = words(4 * BLOCK_SIZE)
    return [shared + words(12 + 4 * i) for i in range(4)] + [words(44), words(52)]


@dataclass
class Stack:
    """An in-process daemon and engine serving one model."""

    app: EngineApp
    address: str
    daemon: Daemon
    daemon_server: Server

    def stop(self) -> None:
        self.app.stop()
        self.daemon_server.stop(grace_s=1)
        self.daemon.close()


def start_stack(model_dir: Path, workdir: str) -> Stack:
    daemon = Daemon(DaemonConfig(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, shm_dir=workdir, lease_s=30))
    daemon_server = build_server(daemon, None)
    socket_path = os.path.join(workdir, "kvd.sock")
    daemon_server.add_port(f"unix:{socket_path}")
    daemon_server.start()
    app = EngineApp(
        EngineSettings(
            model=str(model_dir), dtype="float64", device="cpu", kvd_address=f"unix:{socket_path}",
            listen="127.0.0.1:0", token_budget=TOKEN_BUDGET, attention_backend="torch",
        )
    )  # fmt: skip
    app.start()
    address = f"127.0.0.1:{app.port}"
    wait_serving(address, timeout_s=60)
    return Stack(app, address, daemon, daemon_server)


@pytest.fixture
def short_workdir() -> Iterator[str]:
    # NOTE: unix socket paths are limited to ~107 bytes; pytest's tmp_path can be longer.
    with tempfile.TemporaryDirectory(prefix="kvd-", dir="/tmp") as path:
        yield path


@pytest.fixture
def stack_of(short_workdir) -> Iterator:
    stacks: list[Stack] = []

    def start(model_dir: Path) -> Stack:
        stacks.append(start_stack(model_dir, short_workdir))
        return stacks[-1]

    yield start
    for stack in stacks:
        stack.stop()


def pytest_generate_tests(metafunc):
    if "model_type" in metafunc.fixturenames:
        chosen = [f for f in metafunc.config.getoption("--families").split(",") if f] or list(FAMILIES)
        unknown = set(chosen) - set(FAMILIES)
        if unknown:
            raise pytest.UsageError(f"--families: unknown {sorted(unknown)}; known: {', '.join(FAMILIES)}")
        metafunc.parametrize("model_type", chosen)


def test_family_is_token_exact_with_windows_chunks_cache_hits_and_preemption(
    model_type, stack_of, short_workdir, caplog
):
    model_dir = Path(short_workdir) / model_type
    reference = build(FAMILIES[model_type], model_dir)
    stack = stack_of(model_dir)
    engine = stub(stack.address)
    token_lists = prompts(seed=len(model_type))
    assert min(map(len, token_lists)) > max(WINDOW, TOKEN_BUDGET)

    with caplog.at_level(logging.INFO, logger="inference.engine"), cf.ThreadPoolExecutor(len(token_lists)) as pool:
        results = list(pool.map(lambda ids: generate(engine, request(ids, NEW_TOKENS)), token_lists))
    for ids, (tokens, _, _) in zip(token_lists, results, strict=True):
        assert tokens == reference_greedy(reference, ids, NEW_TOKENS), f"{model_type}: prompt of {len(ids)}"
    assert any("preempted" in r.getMessage() for r in caplog.records), "the pool was meant to force preemption"

    # One at a time, a prompt sharing the previous one's first 4 blocks reads them from the cache.
    first, second = (token_lists[0][: 4 * BLOCK_SIZE] + token_lists[i][:20] for i in (4, 5))
    generate(engine, request(first, NEW_TOKENS))
    tokens, logprobs, final = generate_with_logprobs(engine, second)
    assert final.usage.cached_prompt_tokens == 4 * BLOCK_SIZE
    expected_tokens, expected_logprobs = reference_with_logprobs(reference, second)
    assert tokens == expected_tokens
    # The family's own head made the logits (Gemma 2's final soft-capping, Granite's scaling).
    torch.testing.assert_close(torch.tensor(logprobs, dtype=torch.float64), expected_logprobs, rtol=1e-5, atol=1e-5)

    assert engine.Info(pb.InfoRequest()).model_type == model_type
    assert_chat_renders_as_apply_chat_template(engine, model_dir)


def generate_with_logprobs(engine, token_ids: list[int]):
    """The engine's greedy tokens, their logprobs and the final message."""
    tokens, logprobs, last = [], [], None
    for message in engine.Generate(request(token_ids, NEW_TOKENS, logprobs=True), timeout=120):
        tokens.extend(message.token_ids)
        logprobs.extend(message.logprobs)
        last = message
    return tokens, logprobs, last


def reference_with_logprobs(model, token_ids: list[int]) -> tuple[list[int], torch.Tensor]:
    """`generate`'s greedy tokens and each one's log-probability under the model's logits."""
    ids = torch.tensor([token_ids])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
        pad_token_id=model.config.pad_token_id, return_dict_in_generate=True, output_logits=True,
    )  # fmt: skip
    tokens = out.sequences[0, len(token_ids) :]
    logprobs = torch.stack([step[0].double().log_softmax(dim=-1) for step in out.logits])
    return tokens.tolist(), logprobs.gather(1, tokens[:, None])[:, 0]


def assert_chat_renders_as_apply_chat_template(engine, model_dir: Path) -> None:
    """Tokenize renders the family's chat template as the tokenizer itself does."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    messages = [{"role": "system", "content": "t40 t41"}, {"role": "user", "content": "t50 t51 t52"}]
    for add_prompt in (True, False):
        chat = pb.ChatPrompt(messages=[pb.ChatMessage(**m) for m in messages], add_generation_prompt=add_prompt)
        reply = engine.Tokenize(pb.TokenizeRequest(chat=chat))
        expected = tokenizer.apply_chat_template(messages, add_generation_prompt=add_prompt, tokenize=True)
        assert list(reply.token_ids) == list(getattr(expected, "input_ids", expected))


def test_every_verified_family_is_in_the_matrix():
    assert set(VERIFIED_FAMILIES) == set(FAMILIES)
