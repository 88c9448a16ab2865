"""CUDA: the host tier behind a GPU cache: copies on the daemon's stream, the
engine's stream waiting on interprocess events; outputs still match generate.

float32, so that a block copied wrong shows as a divergence: in bfloat16 this
random model's near-ties make most outputs diverge anyway."""

from __future__ import annotations

import concurrent.futures as cf

import pytest
import torch

from kvd.common.client import DaemonClient
from tests.conftest import start_daemon, start_engine, wait_for
from tests.integration.engine_client import (
    assert_close_to_reference,
    reference_generate,
    stream_with_top5,
    stub,
)

pytestmark = pytest.mark.gpu

NEW_TOKENS = 8


def test_host_tier_on_cuda_serves_evicted_prefixes_exactly(random_llama_float32, workdir):
    folder, model = random_llama_float32
    # 4 documents of 19 blocks do not fit in 48 device blocks; the host holds all.
    daemon = start_daemon(
        ["--device", "cuda", "--block-size", "16", "--num-blocks", "48", "--host-num-blocks", "512"], workdir
    )
    engine = start_engine(daemon, ["--model", str(folder), "--device", "cuda", "--dtype", "float32"], workdir)
    try:
        generator = torch.Generator().manual_seed(2)
        docs = [torch.randint(3, 32000, (300,), generator=generator).tolist() for _ in range(4)]
        client = stub(engine.address)
        identical = 0
        for _ in range(2):  # the second round's documents come back from the host tier
            prompts = [doc + torch.randint(3, 32000, (12,), generator=generator).tolist() for doc in docs]
            with cf.ThreadPoolExecutor(len(prompts)) as pool:
                results = list(pool.map(lambda ids: stream_with_top5(client, ids, NEW_TOKENS), prompts))
            for ids, result in zip(prompts, results, strict=True):
                identical += assert_close_to_reference(*result, *reference_generate(model, ids, NEW_TOKENS))
        with DaemonClient.connect(daemon.address) as dc:
            assert wait_for(lambda: dc.stats().num_used_blocks == 0 and dc.stats().num_copying_blocks == 0)
            stats = dc.stats()
        assert stats.host_hit_tokens > 0 and stats.bytes_from_host > 0, stats
        print(f"float32: {identical}/8 identical")
        assert identical >= 7, f"only {identical} of 8 outputs identical to generate in float32"
    finally:
        engine.stop()
        daemon.stop()
