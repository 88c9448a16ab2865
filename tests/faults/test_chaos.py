"""The chaos benchmark's short variant (benchmarks/chaos.py --quick): each
fault of its schedule, one at a time, under gRPC and HTTP streaming load,
plain and templated, through two engines on one daemon with the host and
disk tiers on. Whatever the machine's speed: no wrong token, no status the
docs do not give, a drain that fails nothing, and nothing held afterwards."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchmarks.harness.report import REPO_ROOT


def test_every_fault_under_mixed_load_keeps_every_answer_exact(workdir):
    out = f"{workdir}/chaos.json"
    run = subprocess.run(
        [sys.executable, "benchmarks/chaos.py", "--quick", "--json", out],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=1500,
    )  # fmt: skip
    # The stderr's end holds the failure, with the processes' last log lines (chaos.ChaosStack.describe).
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-16000:]
    print(run.stdout)
    report = json.loads(Path(out).read_text())
    faults, after, ratios = report["results"]["faults"], report["results"]["after"], report["ratios"]
    assert sorted(faults) == sorted(["engine_kill", "daemon_kill", "gateway_kill", "redis_restart", "engine_drain"])
    assert ratios["wrong_tokens_total"] == 0, faults
    assert ratios["undocumented_statuses"] == 0, report["results"]["all"]["undocumented"]
    assert faults["engine_drain"]["failed_by_status"] == {}, faults["engine_drain"]  # a drain loses nothing
    assert (after["blocks_held"], after["blocks_quarantined"], after["corrupt_blocks_served"]) == (0, 0, 0), after
