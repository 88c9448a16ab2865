"""The family matrix: each architecture the engine serves, token-exact against
transformers' `model.generate`, or refused at start.

Per family (tests/model_families.py, a tiny random-weight float64 model): a
real daemon and a real engine, both in this process on real sockets (the
daemon's cache is made for each model's layout), serve concurrent prompts
longer than the sliding window, sharing a prefix (cache hits), prefilled in
chunks shorter than the prompts, on a pool too small to hold them all
(preemption). Every greedy token must equal `generate`'s.

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

import grpc
import pytest

from inference.app import EngineApp, EngineSettings
from inference.model_support import VERIFIED_FAMILIES
from kvd.daemon import Daemon, DaemonConfig
from kvd.service import build_server
from kvd_api.engine.v1 import engine_pb2 as pb
from tests.conftest import wait_serving
from tests.integration.engine_client import generate, reference_greedy, request, stub
from tests.model_families import FAMILIES, VOCAB, WINDOW, build

NEW_TOKENS = 8
BLOCK_SIZE = 8
TOKEN_BUDGET = 24  # shorter than every prompt: each is prefilled in chunks
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
    daemon_server: grpc.Server

    def stop(self) -> None:
        self.app.stop()
        self.daemon_server.stop(grace=1).wait()
        self.daemon.close()


def start_stack(model_dir: Path, workdir: str) -> Stack:
    daemon = Daemon(DaemonConfig(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, shm_dir=workdir, lease_s=30))
    daemon_server = build_server(daemon, None)
    socket_path = os.path.join(workdir, "kvd.sock")
    daemon_server.add_insecure_port(f"unix:{socket_path}")
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
    tokens, _, final = generate(engine, request(second, NEW_TOKENS))
    assert final.usage.cached_prompt_tokens == 4 * BLOCK_SIZE
    assert tokens == reference_greedy(reference, second, NEW_TOKENS)

    assert engine.Info(pb.InfoRequest()).model_type == model_type
    assert_chat_renders_as_apply_chat_template(engine, model_dir)


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
