"""CUDA: the family matrix on the GPU. Each family's tiny random model
(tests/model_families.py) in float32 through the Triton backend, served by
an engine (in this process) on a daemon process's CUDA cache, against
`model.generate` of the same float32 weights on the GPU: identical up to the
first divergence, where each side's token is among the other's top 5.

Prompts longer than the windows, sharing a prefix, prefilled in chunks, on a
pool small enough to preempt: the CPU matrix's workload. Each family's result
(identical prompts of six, or its error) goes to ``$KVD_GPU_OUT/families.json``
after each family when that is set (tests/gpu/run.sh sets it): the README's
"exact on GPU" column.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
from pathlib import Path

import pytest
import torch

from inference import model_store
from inference.app import EngineApp
from inference.config import EngineSettings
from tests.conftest import start_daemon, wait_serving
from tests.integration.engine_client import assert_close_to_reference, reference_generate, stream_with_top5, stub
from tests.integration.test_model_families import prompts
from tests.model_families import FAMILIES, TOKEN_BUDGET, build

pytestmark = pytest.mark.gpu

NEW_TOKENS = 8
BLOCK_SIZE = 16  # the Triton backend's multiple
NUM_BLOCKS = 10  # holds any one sequence (at most 5 blocks), never all six at once


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    return {}


def save(results: dict[str, dict]) -> None:
    """Rewrites families.json (after each family: a run cut short keeps the ones done)."""
    out = os.environ.get("KVD_GPU_OUT")
    if out:
        Path(out, "families.json").write_text(json.dumps(results, indent=2, sort_keys=True))


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_family_on_cuda_matches_generate(model_type, workdir, results):
    model_dir = Path(workdir) / model_type
    build(FAMILIES[model_type], model_dir)
    reference = model_store.load_model(model_dir, torch.float32, "cuda")
    daemon = start_daemon(
        ["--device", "cuda", "--block-size", str(BLOCK_SIZE), "--num-blocks", str(NUM_BLOCKS), "--lease-s", "30"],
        workdir,
    )
    app = EngineApp(
        EngineSettings(
            model=str(model_dir), dtype="float32", device="cuda", kvd_address=daemon.address, listen="127.0.0.1:0",
            token_budget=TOKEN_BUDGET, attention_backend="triton",
        )
    )  # fmt: skip
    app.start()
    results[model_type] = {"identical": None, "prompts": None, "gpu": torch.cuda.get_device_name()}
    try:
        address = f"127.0.0.1:{app.port}"
        wait_serving(address, timeout_s=60)
        engine = stub(address)
        token_lists = prompts(seed=len(model_type))
        with cf.ThreadPoolExecutor(len(token_lists)) as pool:
            outputs = list(pool.map(lambda ids: stream_with_top5(engine, ids, NEW_TOKENS), token_lists))
        identical = sum(
            assert_close_to_reference(*output, *reference_generate(reference, ids, NEW_TOKENS))
            for ids, output in zip(token_lists, outputs, strict=True)
        )
        results[model_type].update(identical=identical, prompts=len(token_lists))
        assert app.engine.num_preempted > 0, "the pool was meant to force preemption"
    except BaseException as err:
        results[model_type]["error"] = f"{type(err).__name__}: {err}"[:2000]
        raise
    finally:
        save(results)
        app.stop()
        daemon.stop()
