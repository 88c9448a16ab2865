"""CUDA graphs on a GPU: what tests/unit/test_cuda_graphs.py drives on the CPU
through a stand-in, confirmed with real graphs on the random-weight Llama.

- A replay equals an eager forward of the same padded inputs and launch
  shapes bitwise (logits and cache bytes), for decode buckets (the KV split
  in as many ranges as the model's 4,096 positions call for, whatever the
  sequences' lengths) and a mixed bucket, in bfloat16 and float32; it writes
  no cache slot but the step's own.
- A graphed decode step blocks once (the sampled tokens' transfer); its
  forward never does.
- The engine (graphs on: CUDA + Triton) matches ``generate`` before and after
  its daemon restarts, capturing again on the new cache.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import signal
import warnings

import pytest
import torch

from inference import attention
from inference.cuda_graphs import CudaGraphCapture, GraphPlan, capture_graphs
from inference.model_runner import ModelRunner
from inference.sampling import Sampler, SamplingParams
from inference.step_inputs import Chunk
from tests.conftest import start_daemon, start_engine, wait_for
from tests.integration.engine_client import (
    assert_close_to_reference,
    reference_generate,
    stream_with_top5,
    stub,
)

pytestmark = pytest.mark.gpu
BLOCK = 16
NUM_BLOCKS = 512
PLAN = GraphPlan(decode_sizes=(1, 4, 16), mixed_sizes=(64,), mixed_seqs=16, max_context=4096)


def graphed_runner(model) -> ModelRunner:
    attention.choose_backend("torch", "cuda")
    model.set_attn_implementation(attention.BACKENDS["triton"])
    c = model.config
    shape = (NUM_BLOCKS, c.num_hidden_layers, 2, BLOCK, c.num_key_value_heads, c.hidden_size // c.num_attention_heads)
    generator = torch.Generator(device="cuda").manual_seed(0)
    cache = torch.randn(shape, generator=generator, device="cuda").to(next(model.parameters()).dtype)
    runner = ModelRunner(model, cache, BLOCK)
    runner.graphs = capture_graphs(runner, PLAN, CudaGraphCapture(runner.device))
    assert runner.graphs is not None, "capture failed: see the log"
    return runner


def steps() -> list[tuple[str, list[Chunk]]]:
    """A mixed step (4 prompts, 60 tokens), then decodes of 3, 16 and 1
    sequences over random cached K/V, the last at 2,000 positions."""
    order = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(1)).tolist()
    tables = [order[i * 32 : (i + 1) * 32] for i in range(16)]  # 512 positions each, no block shared
    tokens = torch.randint(3, 30000, (64,), generator=torch.Generator().manual_seed(2)).tolist()
    lengths = torch.randint(1, 500, (16,), generator=torch.Generator().manual_seed(3)).tolist()
    return [
        ("mixed 64", [Chunk(tokens[i * 15 : (i + 1) * 15], 0, tables[i], 0, True, f"m{i}") for i in range(4)]),
        ("decode 4", [Chunk([tokens[i]], n, tables[i], n, True, f"d{i}") for i, n in enumerate((100, 300, 511))]),
        ("decode 16", [Chunk([tokens[i]], lengths[i], tables[i], lengths[i], True, f"d{i}") for i in range(16)]),
        ("decode 1", [Chunk([tokens[0]], 2000, order[:126], 2000, True, "long")]),
    ]


def written_slots(chunks: list[Chunk]) -> set[int]:
    positions = ((c, p) for c in chunks for p in range(c.first, c.first + len(c.token_ids)))
    return {c.block_table[p // BLOCK] * BLOCK + p % BLOCK for c, p in positions}


@pytest.mark.parametrize("fixture", ["random_llama_model", "random_llama_float32"], ids=["bf16", "f32"])
def test_a_replay_equals_the_eager_forward_of_its_padded_inputs_bitwise(fixture, request):
    _, model = request.getfixturevalue(fixture)
    runner = graphed_runner(model)
    cache = runner.kv_cache
    assert runner.graphs.buckets[0].launch.num_splits > 1  # batch 1: the KV of 4,096 positions split
    for replays, (name, chunks) in enumerate(steps(), start=1):
        before = cache.clone()
        graphed = runner.forward(chunks).clone()
        after = cache.clone()
        assert runner.graphs.replays == replays, f"{name}: no replay"
        changed = (before != after).transpose(1, 3).flatten(0, 1).flatten(1).any(dim=1)  # per slot
        assert set(torch.nonzero(changed).flatten().tolist()) == written_slots(chunks), f"{name}: padding wrote"
        cache.copy_(before)
        eager = runner.graphs.eager(chunks)
        assert torch.isfinite(graphed).all(), name
        assert torch.equal(graphed, eager), f"{name}: max difference {(graphed - eager).abs().max().item()}"
        assert torch.equal(cache, after), f"{name}: the eager forward wrote other K/V"
    del runner, cache
    torch.cuda.empty_cache()


def test_a_graphed_decode_step_blocks_once_and_its_forward_never(random_llama_model):
    _, model = random_llama_model
    runner, sampler = graphed_runner(model), Sampler()
    _, chunks = steps()[2]  # 16 decodes
    params, generators = [SamplingParams()] * len(chunks), [None] * len(chunks)
    sampler.sample(runner.forward(chunks), params, generators)  # the step's first run
    torch.cuda.synchronize()
    replays = runner.graphs.replays
    torch.cuda.set_sync_debug_mode("error")  # any blocking sync in the forward raises
    try:
        logits = runner.forward(chunks)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            sampler.sample(logits, params, generators)
            sampler.sample(runner.forward(chunks), params, generators)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert sum("synchroniz" in str(w.message) for w in caught) == 2  # one per sampled step
    assert runner.graphs.replays == replays + 2


def captures(engine) -> list[dict]:
    lines = (json.loads(line) for line in engine.log().splitlines() if line.startswith("{"))
    return [entry for entry in lines if entry.get("logger") == "inference.cuda_graphs"]


def test_the_engine_matches_generate_with_graphs_and_captures_again_after_its_daemon_restarts(
    random_llama_float32, workdir
):
    folder, model = random_llama_float32
    daemon_args = ["--device", "cuda", "--block-size", "16", "--num-blocks", "1024"]
    daemon = start_daemon(daemon_args, workdir)
    engine_args = ["--model", str(folder), "--device", "cuda", "--dtype", "float32", "--cuda-graphs", "on",
                   "--max-num-seqs", "8", "--token-budget", "256"]  # fmt: skip
    engine = start_engine(daemon, engine_args, workdir)
    generator = torch.Generator().manual_seed(4)
    prefix = torch.randint(3, 32000, (100,), generator=generator).tolist()
    prompts = [prefix + torch.randint(3, 32000, (20,), generator=generator).tolist() for _ in range(4)]
    expected = [reference_generate(model, ids, 12) for ids in prompts]

    def identical_outputs() -> int:
        client = stub(engine.address)
        with cf.ThreadPoolExecutor(len(prompts)) as pool:
            results = list(pool.map(lambda ids: stream_with_top5(client, ids, 12), prompts))
        return sum(assert_close_to_reference(*r, *e) for r, e in zip(results, expected, strict=True))

    try:
        assert [e["msg"] for e in captures(engine)] == ["captured CUDA graphs"], engine.log()[-3000:]
        assert identical_outputs() >= 3
        daemon.stop(signal.SIGKILL)
        daemon = start_daemon(daemon_args, workdir)  # the same socket: the engine attaches again
        assert wait_for(lambda: len(captures(engine)) == 2, 120), engine.log()[-3000:]
        assert all(e["msg"] == "captured CUDA graphs" for e in captures(engine)), captures(engine)
        assert identical_outputs() >= 3
    finally:
        engine.stop()
        daemon.stop()
