"""The routing simulator's quick mode: it drives the real Router over every
workload (a JSONL trace included) and writes the JSON its keys promise."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def write_trace(path: Path) -> None:
    """Conversations in the trace form: each turn's hash ids extend the last turn's."""
    rng = random.Random(3)
    rows, next_id = [], 1000
    for c in range(40):
        ids, t = [1, 2], c * 700  # two blocks of a shared system prompt
        for _ in range(3):
            ids = ids + list(range(next_id, next_id + rng.randint(2, 8)))
            next_id += 10
            rows.append({"timestamp": t, "input_length": len(ids) * 512 + 100, "output_length": 50, "hash_ids": ids})
            t += 4000
    path.write_text("\n".join(json.dumps(r) for r in sorted(rows, key=lambda r: r["timestamp"])))


def test_the_quick_run_reports_every_policy_on_every_workload(tmp_path):
    trace = tmp_path / "trace.jsonl"
    write_trace(trace)
    out = tmp_path / "sim.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "routing_sim.py"), "--json", str(out), "--quick",
           "--duration-s", "30", "--trace", str(trace)]  # fmt: skip
    subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True, timeout=120)
    data = json.loads(out.read_text())
    assert data["benchmark"] == "routing_sim" and data["quick"] is True
    cells = data["results"]
    assert sorted(cells) == ["chat/4/0.8", "templates/4/0.8", "trace:trace.jsonl/4/0.8"]
    for cell, by_policy in cells.items():
        assert sorted(by_policy) == ["affinity", "cost", "oracle", "round-robin"], cell
        for policy, s in by_policy.items():
            assert s["requests"] > 0 and 0 <= s["hit_rate"] <= 1, (cell, policy, s)
            assert 0 < s["ttft_p50_s"] <= s["ttft_p90_s"] and len(s["utilisation"]) == 4
        ratios = data["ratios"][cell]
        assert set(ratios) == {"cost_over_oracle_ttft_mean", "cost_over_oracle_ttft_p90", "cost_over_best_hit_rate",
                               "cost_over_round_robin_ttft_mean", "oracle_over_round_robin_ttft_mean"}  # fmt: skip
    assert set(data["ratios"]) - set(cells) == {"worst_ttft_over_oracle", "worst_hit_over_best",
                                                "worst_ttft_over_round_robin"}  # fmt: skip
    # Multi-turn chat: the turns that follow find their conversation's blocks where cost sent them.
    chat = cells["chat/4/0.8"]
    assert chat["cost"]["hit_rate"] > chat["round-robin"]["hit_rate"]
    assert chat["cost"]["ttft_mean_s"] < chat["round-robin"]["ttft_mean_s"]
