"""The soak script's 30-second version (benchmarks/load.py --quick): 16 streaming
clients, three tenants, cancels, expiring deadlines and vanished clients;
only the expected statuses, and nothing held by requests in any tier after.
The five-minute run is the script itself (see its docstring)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.long
def test_quick_soak_leaves_nothing_held(tmp_path):
    out = tmp_path / "load.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "protos")])}
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "load.py"), "--quick", "--json", str(out)],
        capture_output=True, text=True, timeout=280, env=env,
    )  # fmt: skip
    assert out.exists(), run.stdout + run.stderr
    soak = json.loads(out.read_text())["results"]["soak"]
    assert set(soak["errors_by_status"]) <= {"CANCELLED", "DEADLINE_EXCEEDED"}, soak["errors_by_status"]
    assert soak["requests_ok"] > 0
    assert soak["behaviours"]["cancel"] + soak["behaviours"]["drop"] > 0  # the run did abandon streams
    assert soak["blocks_held_after"] == {"device": 0, "device_copying": 0, "host_being_read": 0, "requests": 0}
    assert run.returncode == 0, run.stdout + run.stderr
