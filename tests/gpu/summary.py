"""The GPU check's table: each target of issue 23 beside what this run measured.

    python3 tests/gpu/summary.py OUTDIR    (tests/gpu/run.sh calls it last)

Reads what the parts left in OUTDIR (the JSON of the benchmarks, tests.xml,
families.json), writes OUTDIR/summary.json and prints the table. A figure
whose part did not finish shows as missing, never as a pass.
"""

from __future__ import annotations

import json
import operator
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

#: (label, file, key path, comparison, target)
TARGETS = [
    ("decode GPU time / floor, batch 16", "gpu_step.json", "ratios.decode_over_floor_b16", "<=", 2.0),
    ("decode GPU time / floor, batch 64", "gpu_step.json", "ratios.decode_over_floor_b64", "<=", 2.0),
    ("engine wall / GPU time per step, b16", "gpu_step.json", "ratios.wall_over_gpu_b16", "<=", 1.2),
    ("Triton decode attention: bandwidth share", "gpu_step.json", "ratios.attention_bandwidth_share", ">=", 0.6),
    ("Triton decode vs gathered SDPA (SDPA / Triton)", "gpu_step.json", "ratios.triton_over_sdpa_decode", ">=", 1.0),
    ("512-token prefill over 2,000 (SDPA / Triton)", "gpu_step.json", "ratios.triton_over_sdpa_prefill", ">=", 0.5),
    ("e2e throughput / HF continuous batching", "gpu_e2e.json", "ratios.throughput_vs_hf_cb", ">=", 5.0),
    ("e2e TTFT / HF continuous batching", "gpu_e2e.json", "ratios.ttft_vs_hf_cb", "<=", 0.3),
    ("large e2e throughput / HF continuous batching", "gpu_e2e_large.json", "ratios.throughput_vs_hf_cb", ">=", 5.0),
    ("large e2e TTFT / HF continuous batching", "gpu_e2e_large.json", "ratios.ttft_vs_hf_cb", "<=", 0.3),
]
_COMPARE = {"<=": operator.le, ">=": operator.ge}


def _load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _get(data: dict | None, dotted: str) -> Any:
    for key in dotted.split("."):
        if not isinstance(data, dict) or key not in data:
            return None
        data = data[key]
    return data


def _tests(out: Path) -> dict:
    try:
        suite = ET.parse(out / "tests.xml").getroot()
    except (OSError, ET.ParseError):
        return {"ran": False}
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    failed = [
        f"{case.get('classname')}::{case.get('name')}"
        for case in suite.iter("testcase")
        if case.find("failure") is not None or case.find("error") is not None
    ]
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    return {"ran": True, **counts, "failed": failed}


def summarize(out: Path) -> dict:
    rows = []
    for label, file, key, op, target in TARGETS:
        value = _get(_load(out / file), key)
        met = None if not isinstance(value, (int, float)) else _COMPARE[op](value, target)
        rows.append({"target": label, "key": f"{file}:{key}", "value": value, "wanted": f"{op} {target}", "met": met})
    e2e = {name: _load(out / f"{name}.json") for name in ("gpu_e2e", "gpu_e2e_large")}
    step = _load(out / "gpu_step.json") or {}
    syncs = {case: r.get("blocking_syncs_per_step") for case, r in (_get(step, "results.decode") or {}).items()}
    return {
        "gpu": _get(step, "machine.gpu") or _get(e2e["gpu_e2e"], "machine.gpu"),
        "targets": rows,
        "tests": _tests(out),
        "blocking_syncs_per_step": syncs,
        "tokens_match_hf_generate": {
            name: {
                variant: r.get("tokens_match_hf_generate")
                for variant, r in (_get(data, "results") or {}).items()
                if isinstance(r, dict) and "tokens_match_hf_generate" in r
            }
            for name, data in e2e.items()
        },
        "families": _load(out / "families.json"),
        "parts": (out / "summary.txt").read_text().splitlines() if (out / "summary.txt").exists() else [],
    }


def main() -> int:
    out = Path(sys.argv[1])
    summary = summarize(out)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"GPU: {summary['gpu']}")
    for line in summary["parts"]:
        print(f"  {line}")
    tests = summary["tests"]
    if tests["ran"]:
        counts = f"{tests['tests']} run, {tests['failures']} failed, {tests['errors']} errors"
        print(f"tests: {counts}, {tests['skipped']} skipped")
        for name in tests["failed"]:
            print(f"  FAILED {name}")
    else:
        print("tests: no tests.xml")
    print(f"{'target':<52} {'measured':>10} {'wanted':>8}  met")
    for row in summary["targets"]:
        value = row["value"]
        shown = f"{value:.3f}" if isinstance(value, (int, float)) else "missing"
        met = {True: "yes", False: "NO", None: "-"}[row["met"]]
        print(f"{row['target']:<52} {shown:>10} {row['wanted']:>8}  {met}")
    print(f"blocking syncs per decode step: {summary['blocking_syncs_per_step']}")
    print(f"tokens match generate: {summary['tokens_match_hf_generate']}")
    print(f"families (identical of prompts): {summary['families']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
