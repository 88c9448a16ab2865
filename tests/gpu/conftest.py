"""Fixtures of the GPU tests, and their failures reported the moment they happen.

A GPU run's parts are cut at a time limit (tests/gpu/run.sh); pytest would
print a failure's traceback only at the end of the session, which a cut part
never reaches. So each failure is printed as it happens, with the last lines
of every log in the test's working folder (its daemons' and engines'), before
teardown deletes that folder.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from inference import model_store
from tests.gpu import random_llama

LOG_TAIL_LINES = 80


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        write = item.config.pluginmanager.get_plugin("terminalreporter").write_line
        write(f"\n=== FAILED {item.nodeid} ({report.when}) {'=' * 20}")
        write(report.longreprtext)
        for line in _log_tails(item.funcargs.get("workdir")):
            write(line)
        write(f"=== end of {item.nodeid} {'=' * 20}", flush=True)


def _log_tails(workdir: str | None) -> list[str]:
    """The last lines of each log under the test's working folder."""
    lines = []
    for log in sorted(Path(workdir).rglob("*.log")) if workdir else []:
        tail = log.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
        lines += [f"--- {log.name}, last {len(tail)} lines ---", *tail]
    return lines


@pytest.fixture(scope="session")
def random_llama_folder(tmp_path_factory) -> Path:
    """tests/gpu/random_llama.py's model: ``$KVD_GPU_MODEL`` when set (tests/gpu/run.sh
    builds it once for the tests and the benchmarks), else built here once per run."""
    prebuilt = os.environ.get("KVD_GPU_MODEL")
    if prebuilt and Path(prebuilt, "config.json").exists():
        return Path(prebuilt)
    folder = tmp_path_factory.mktemp("random-llama")
    random_llama.build(folder, device="cuda")  # seconds there; tens of seconds on a CPU
    return folder


@pytest.fixture(scope="session")
def random_llama_model(random_llama_folder):
    """(folder, the model in bfloat16 on CUDA), loaded as the engine loads it
    (its rotary buffers stay float32, as the engine's do)."""
    return random_llama_folder, model_store.load_model(random_llama_folder, torch.bfloat16, "cuda")


@pytest.fixture(scope="session")
def random_llama_float32(random_llama_folder):
    """(folder, the same weights in float32 on CUDA), loaded as the engine loads them."""
    return random_llama_folder, model_store.load_model(random_llama_folder, torch.float32, "cuda")
