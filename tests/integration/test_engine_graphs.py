"""The engine with CUDA graphs on, driven on the CPU: it captures after it
attaches and again after the daemon comes back (a new cache), its pipelined
loop replays them, and its greedy tokens equal ``model.generate``'s.

A real daemon runs in-process on a unix socket; the model is a tiny random
float32 Llama through the Triton backend in Triton's interpreter, its graphs
captured with :class:`inference.cuda_graphs.EagerStandIn` (the engine picks it
where there is no CUDA). tests/gpu/test_graphs_cuda.py runs the same on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from inference import attention
from inference.config import EngineConfig
from inference.engine import Engine
from inference.requests import Finish, Sequence
from inference.sampling import SamplingParams
from kvd.common.layout import CacheLayout
from kvd.config import DaemonConfig
from kvd.daemon import Daemon
from kvd.service import build_server
from tests.conftest import wait_for
from tests.integration.engine_client import reference_greedy
from tests.model_families import tiny_llama

BS = 16
NEW_TOKENS = 4


class InProcessDaemon:
    def __init__(self, folder: str, layout: CacheLayout) -> None:
        self.daemon = Daemon(DaemonConfig(block_size=BS, num_blocks=24, shm_dir=folder, model_layout=layout))
        self.server = build_server(self.daemon, None)
        self.address = f"unix:{folder}/kvd.sock"
        self.server.add_port(self.address)
        self.server.start()

    def stop(self) -> None:
        self.server.stop(grace_s=0)
        self.daemon.close()


class Tokens:
    def decode(self, ids, skip_special_tokens=True) -> str:
        return " ".join(map(str, ids))


def generate(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    seqs = [Sequence(f"r{i}", p, SamplingParams(max_new_tokens=NEW_TOKENS)) for i, p in enumerate(prompts)]
    for seq in seqs:
        engine.submit(seq)
    assert wait_for(lambda: all(s.is_finished for s in seqs), 120)
    assert all(s.finish == Finish.LENGTH for s in seqs), [(s.finish, s.error) for s in seqs]
    return [s.output_ids for s in seqs]


@pytest.fixture(scope="module")
def models():
    """(the engine's model through the Triton backend, the same weights for generate)."""
    attention.choose_backend("torch", "cpu")  # registers every backend
    engine_model, reference = tiny_llama(), tiny_llama()
    engine_model.set_attn_implementation(attention.BACKENDS["triton"])
    return engine_model, reference


def test_graphs_are_captured_at_each_attach_and_replayed_with_generates_tokens(models, workdir):
    model, reference = models
    c = model.config
    layout = CacheLayout(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, BS, "float32")
    daemon = InProcessDaemon(workdir, layout)
    engine = Engine(
        model, Tokens(), lambda: _attach(daemon, layout),
        EngineConfig(max_num_seqs=2, token_budget=16, pipelined=True, cuda_graphs=True, max_context=BS * 24),
        eos_token_ids=set(),
    )  # fmt: skip
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, c.vocab_size, (n,), generator=gen).tolist() for n in (9, 6)]
    expected = [reference_greedy(reference, p, NEW_TOKENS) for p in prompts]
    engine.start()
    try:
        assert wait_for(lambda: engine.runner is not None, 60)  # set once its graphs are captured
        first = engine.runner
        assert [(b.tokens, b.seqs) for b in first.graphs.buckets] == [(1, 1), (2, 2), (16, 2)]
        assert generate(engine, prompts) == expected
        assert first.graphs.replays >= NEW_TOKENS  # a prefill and the decodes, each a replay

        daemon.stop()  # the daemon goes away and comes back with a new cache
        daemon = InProcessDaemon(workdir, layout)
        assert wait_for(lambda: engine.runner not in (None, first), 60)
        second = engine.runner
        assert second.kv_cache.data_ptr() != first.kv_cache.data_ptr()
        assert second.graphs is not first.graphs and second.graphs.replays == 0
        # Graphs still aimed at the old cache would read no prompt K/V back here.
        assert generate(engine, prompts[::-1]) == expected[::-1]
        assert second.graphs.replays >= NEW_TOKENS
    finally:
        engine.stop()
        daemon.stop()


def _attach(daemon: InProcessDaemon, layout: CacheLayout):
    from kvd.common.client import DaemonClient

    client = DaemonClient.connect(daemon.address)
    return client.attach("graphs", layout)
