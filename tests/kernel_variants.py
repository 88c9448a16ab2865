"""Every Triton kernel launch the engine and the GPU checks make, driven
through their own code on a given device.

Two users: tests/kernel_compile.py records these launches on CPU tensors and
compiles each distinct variant for GPU targets (no GPU needed), and the GPU
run's preflight (tests/gpu/preflight.py) launches them once on the GPU, which
also fills Triton's cache for the stages after it.

The launches come from:

- **engine paths**: for each model shape the engine serves on a GPU, a
  two-layer stand-in with that shape's attention (heads, KV heads, head dim,
  window, soft-cap, context length) run by :class:`ModelRunner` as the
  engine runs it: the graph capture of its default plan (each bucket's
  forward once, as the capture's warm-up does) and eager steps (a mixed step
  of chunks and decodes, decodes long enough to split the KV, one short
  decode): the default model (SmolLM2-135M), the GPU checks' random Llama,
  and the ten families;
- **direct launches**: tests/gpu/test_kernels_cuda.py's shapes, cases and
  dtypes, its soft-capped windowed case, and benchmarks/gpu_step.py's
  attention shape.

Each case is a :class:`Case`: a label and a function of ``(device,
num_sms)``; :func:`cases` lists them in order.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from inference import attention, model_store
from inference.config import EngineConfig
from inference.cuda_graphs import EagerStandIn, GraphPlan, capture_graphs
from inference.kernels.kv_store import store_kv
from inference.kernels.launch import LaunchShape, choose_splits
from inference.kernels.paged_attention import paged_attention
from inference.model_runner import ModelRunner
from inference.step_inputs import Chunk
from tests.gpu import random_llama

BLOCK = 16  # the daemon's default block size
DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}


@dataclass(frozen=True)
class Case:
    """A group of launches: ``run(device, num_sms)`` makes them."""

    label: str
    run: Callable[[torch.device, int], None]


@dataclass(frozen=True)
class EngineModel:
    """A model shape the engine serves on a GPU, and how it is served there.

    Attributes:
        name: what it stands for.
        config: a two-layer config with that attention shape (its other
            sizes shrunk: only attention reaches the kernels).
        dtypes: the dtypes it is served in on a GPU.
        token_budget: the engine's token budget there (sizes the mixed buckets).
    """

    name: str
    config: Callable[[], object]
    dtypes: tuple[str, ...]
    token_budget: int = EngineConfig.token_budget


def _shrunk(config):
    """``config`` with its attention shape kept and every other size small."""
    config.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    config.hidden_size = 8 * config.num_attention_heads  # a multiple of the heads, as transformers checks
    config.intermediate_size, config.num_hidden_layers, config.vocab_size = 128, 2, 256
    return config


def _smollm2():
    from transformers import LlamaConfig

    # SmolLM2-135M-Instruct's config.json: 9 heads, 3 KV heads, hidden 576 (head dim 64), 8,192 positions.
    config = LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192)
    return _shrunk(config)


def _family(model_type: str) -> Callable[[], object]:
    def config():
        from tests.model_families import FAMILIES

        return FAMILIES[model_type].config()

    return config


def engine_models() -> list[EngineModel]:
    from tests.model_families import FAMILIES, TOKEN_BUDGET

    return [
        EngineModel("SmolLM2-135M", _smollm2, ("bf16", "f16", "f32")),
        EngineModel("random Llama", lambda: _shrunk(random_llama.config()), ("bf16", "f32")),
        *(EngineModel(name, _family(name), ("f32",), TOKEN_BUDGET) for name in FAMILIES),
    ]


def stand_in_runner(model: EngineModel, dtype: torch.dtype, device: torch.device, num_sms: int) -> ModelRunner:
    """A runner of ``model``'s stand-in (random weights, the Triton backend)
    on a random cache of a whole context's blocks."""
    from transformers import AutoModelForCausalLM

    config = model.config()
    torch.manual_seed(0)
    stand_in = AutoModelForCausalLM.from_config(config, dtype=dtype).to(device).eval()
    attention.choose_backend("torch", device.type)  # registers every backend with transformers
    stand_in.set_attn_implementation(attention.BACKENDS["triton"])
    spec = model_store.model_spec(config)  # the engine's reading of the layout and context
    layout = spec.layout
    blocks = -(-spec.max_context // BLOCK) + 8
    shape = (blocks, layout.num_layers, 2, BLOCK, layout.num_kv_heads, layout.head_dim)
    runner = ModelRunner(stand_in, torch.randn(shape, device=device).to(dtype), BLOCK)
    runner.num_sms = num_sms  # on CPU tensors: the target GPU's, so the splits are the GPU's
    return runner


def engine_steps(max_context: int, num_blocks: int) -> list[list[Chunk]]:
    """The eager steps: a mixed step (a prompt, a chunk after cached positions,
    two decodes), two decodes at the longest context up to 2,000 (split KV on
    a GPU), one short decode."""
    long = min(2000, max_context - 1)

    def table(first: int, positions: int) -> list[int]:
        return [(first + i) % num_blocks for i in range(-(-positions // BLOCK))]

    mixed = [
        Chunk(list(range(3, 43)), 0, table(0, 40), 0, True, "prompt"),
        Chunk(list(range(3, 23)), 32, table(10, 52), 32, True, "chunk"),
        Chunk([5], 100, table(20, 101), 100, True, "decode-a"),
        Chunk([6], 200, table(30, 201), 200, True, "decode-b"),
    ]
    decodes = [Chunk([7], long, table(0, long + 1), long, True, f"long-{i}") for i in range(2)]
    return [mixed, decodes, [Chunk([8], 10, table(5, 11), 10, True, "short")]]


def capture_as_the_engine(runner: ModelRunner, token_budget: int) -> None:
    """Runs the graph capture of the engine's default plan once (each bucket's
    warm-up forward: its launches), the graphs left unused: the runner's steps
    stay eager."""
    plan = GraphPlan.for_engine(EngineConfig.max_num_seqs, token_budget, runner.model.config.max_position_embeddings)
    if capture_graphs(runner, plan, EagerStandIn()) is None:
        raise RuntimeError("the capture failed (its error is logged above)")


def _engine_case(spec: EngineModel, dtype: str) -> Case:
    def run(device: torch.device, num_sms: int) -> None:
        runner = stand_in_runner(spec, DTYPES[dtype], device, num_sms)
        capture_as_the_engine(runner, spec.token_budget)
        for chunks in engine_steps(runner.model.config.max_position_embeddings, runner.kv_cache.shape[0]):
            runner.forward(chunks)

    return Case(f"engine {spec.name} {dtype}: capture + eager steps", run)


def random_steps_case(steps: int, seed: int = 0) -> Case:
    """The default model's capture, then ``steps`` random eager steps (1-24
    sequences, decodes and chunks of up to 300 tokens, contexts log-uniform up
    to 4,000): the packed inputs' alignments, the tables' widths and the split
    counts vary from step to step."""

    def run(device: torch.device, num_sms: int) -> None:
        spec = engine_models()[0]
        runner = stand_in_runner(spec, torch.bfloat16, device, num_sms)
        capture_as_the_engine(runner, spec.token_budget)
        rng = random.Random(seed)
        for step in range(steps):
            chunks = []
            for i in range(rng.randint(1, 24)):
                q_len = 1 if rng.random() < 0.7 else rng.randint(2, 300)
                first = min(int(math.exp(rng.uniform(0, math.log(4000)))), 4000 - q_len)  # short ones as often
                blocks = [rng.randrange(runner.kv_cache.shape[0]) for _ in range(-(-(first + q_len) // BLOCK))]
                chunks.append(Chunk([5] * q_len, first, blocks, first, True, f"s{step}-{i}"))
            runner.forward(chunks)

    return Case(f"{steps} random eager steps of the default model", run)


def _kernel_test_case(dtype: str) -> Case:
    """tests/gpu/test_kernels_cuda.py's launches in one dtype."""

    def run(device: torch.device, num_sms: int) -> None:
        from tests.gpu import test_kernels_cuda as t
        from tests.unit.test_kernels import make_case

        for (kv_heads, group, head_dim), (case, lens) in ((s, c) for s in t.SHAPES for c in t.CASES.items()):
            made = make_case(lens, kv_heads, group, head_dim, t.DTYPES[dtype], seed=len(case) + head_dim)
            cache, table, query_start, seq_lens, query = (x.to(device) for x in made)
            max_q, max_len = max(q for q, _ in lens), max(s for _, s in lens)
            for splits in sorted({1, choose_splits(len(lens), max_q, max_len, kv_heads, num_sms)}):
                shape = LaunchShape(len(lens), max_q, splits)
                paged_attention(query, cache[:, 1, 0], cache[:, 1, 1], table, query_start, seq_lens, shape)
        made = make_case([(1, 300), (40, 333), (1, 20)], 2, 4, 256, t.DTYPES[dtype], seed=3)
        cache, table, query_start, seq_lens, query = (x.to(device) for x in made)
        paged_attention(query, cache[:, 0, 0], cache[:, 0, 1], table, query_start, seq_lens, LaunchShape(3, 40),
                        scale=0.0625, logit_softcap=50.0, sliding_window=64)  # fmt: skip
        cache = torch.zeros(12, 2, 2, BLOCK, 8, 128, dtype=t.DTYPES[dtype], device=device)
        new = torch.zeros(40, 8, 128, dtype=t.DTYPES[dtype], device=device)
        store_kv(new, new, cache[:, 1, 0], cache[:, 1, 1], torch.arange(40, dtype=torch.int32, device=device))

    return Case(f"tests/gpu/test_kernels_cuda.py {dtype}", run)


def _gpu_step_attention(device: torch.device, num_sms: int) -> None:
    """benchmarks/gpu_step.py's attention cases: 8 KV heads, group 4, head dim 128, bfloat16."""
    for batch, q_len, context in ((16, 1, 2000), (64, 1, 2000), (1, 512, 2512)):
        width = -(-context // BLOCK)
        cache = torch.zeros(batch * width, 1, 2, BLOCK, 8, 128, dtype=torch.bfloat16, device=device)
        table = torch.arange(batch * width, dtype=torch.int32, device=device).view(batch, width)
        query = torch.zeros(batch * q_len, 32, 128, dtype=torch.bfloat16, device=device)
        query_start = torch.arange(0, batch * q_len + 1, q_len, dtype=torch.int32, device=device)
        seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
        shape = LaunchShape(batch, q_len, choose_splits(batch, q_len, context, 8, num_sms))
        paged_attention(query, cache[:, 0, 0], cache[:, 0, 1], table, query_start, seq_lens, shape)


def cases() -> Iterator[Case]:
    """Every case, the default model's first."""
    for spec in engine_models():
        for dtype in spec.dtypes:
            yield _engine_case(spec, dtype)
    for dtype in DTYPES:
        yield _kernel_test_case(dtype)
    yield Case("benchmarks/gpu_step.py attention", _gpu_step_attention)
