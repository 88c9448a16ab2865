"""tests/gpu/run.sh, the prepared GPU check, run where there is no GPU: what
it leaves behind when its stages fail is what a GPU run that goes wrong
leaves, so its evidence-keeping is checked here, in every CI run, rather than
discovered on the few GPU minutes the project gets.

Without CUDA, preflight records the machine and the imports and fails its GPU
checks (exit 3: no CUDA IPC), the pytest stage skips its tests, gpu_step says
there is no GPU, and the stages that need IPC are skipped with that reason."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import SESSION_MARK

ROOT = Path(__file__).resolve().parents[2]
COMES_BACK = {"parts.log", "summary.json", "preflight.json", "tests.xml", "gpu_step.json", "gpu_e2e.json",
              "gpu_e2e_large.json", "families.json"}  # fmt: skip


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU run itself checks this on a GPU")
def test_a_gpu_run_without_a_gpu_leaves_each_stages_outcome_and_why(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    env.pop("TRITON_INTERPRET", None)
    # The run's own pytest marks and checks its processes; with this session's
    # mark it would take this run's shell for one of its strays.
    env.pop(SESSION_MARK)
    done = subprocess.run(["bash", "tests/gpu/run.sh", str(out), "preflight", "kernels", "step", "engine"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    left = list(out.iterdir())
    assert all(p.is_file() for p in left) and {p.name for p in left} <= COMES_BACK, left

    summary = json.loads((out / "summary.json").read_text())
    outcomes = {s["stage"]: s["outcome"] for s in summary["stages"]}
    assert outcomes == {
        "preflight": "failed (exit 3)",
        "kernels": "ok",
        "step": "failed (exit 2)",
        "engine": "skipped: preflight's CUDA IPC check failed (see preflight.json)",
    }, outcomes
    assert summary["tests"]["ran"] and summary["tests"]["tests"] == summary["tests"]["skipped"] > 0
    assert all(row["met"] is None for row in summary["targets"])  # nothing measured is nothing passed

    preflight = json.loads((out / "preflight.json").read_text())
    assert preflight["environment"]["ok"] and preflight["imports"]["ok"]
    assert not preflight["gpu"]["ok"] and "Traceback" in preflight["gpu"]["traceback"]
    log = (out / "parts.log").read_text()
    assert "--- gpu failed:" in log and "=== kernels" in log
    assert "engine" in done.stdout and "skipped" in done.stdout  # the stage table, in the reply's tail
