"""The GPU run's report: its stages, each target of issue 31 beside what the
run measured, the tests, which figures ran graphed or eager.

    python3 tests/gpu/summary.py OUTDIR --stage NAME STATUS SECONDS CAP NOTE
    python3 tests/gpu/summary.py OUTDIR

tests/gpu/run.sh calls the first form after each stage (STATUS: the exit
code, or ``skipped``): it records the stage, merges the pytest stages' junit
files (``$KVD_GPU_WORK/junit-*.xml``) into OUTDIR/tests.xml and rewrites
OUTDIR/summary.json, so a run cut short keeps its table. The second form,
last, prints the table. A figure whose stage did not finish shows as
missing, never as a pass.
"""

from __future__ import annotations

import json
import operator
import os
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
_TIMED_OUT = {124, 137}  # timeout's exit codes: TERM, then KILL


def _load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _get(data: Any, dotted: str) -> Any:
    for key in dotted.split("."):
        if not isinstance(data, dict) or key not in data:
            return None
        data = data[key]
    return data


def stage_row(name: str, status: str, seconds: str, cap: str, note: str) -> dict:
    if status == "skipped":
        outcome = f"skipped: {note}"
    elif int(status) == 0:
        outcome = "ok"
    elif int(status) in _TIMED_OUT:
        outcome = f"cut at its cap ({cap} s)"
    else:
        outcome = f"failed (exit {status})"
    return {"stage": name, "outcome": outcome, "seconds": int(seconds), "cap_s": int(cap)}


def merge_junit(out: Path, work: Path) -> None:
    """Every pytest stage's suite, named after its stage, in OUTDIR/tests.xml."""
    merged = ET.Element("testsuites")
    for path in sorted(work.glob("junit-*.xml")):
        try:
            root = ET.parse(path).getroot()
        except ET.ParseError:
            continue
        for suite in [root] if root.tag == "testsuite" else root.iter("testsuite"):
            suite.set("name", path.stem.removeprefix("junit-"))
            merged.append(suite)
    ET.ElementTree(merged).write(out / "tests.xml", encoding="unicode")


def _tests(out: Path) -> dict:
    try:
        root = ET.parse(out / "tests.xml").getroot()
    except (OSError, ET.ParseError):
        return {"ran": False}
    counts = dict.fromkeys(("tests", "failures", "errors", "skipped"), 0)
    failed = []
    for suite in root.iter("testsuite"):
        for key in counts:
            counts[key] += int(suite.get(key, 0))
        failed += [
            f"{suite.get('name')}: {case.get('classname')}::{case.get('name')}"
            for case in suite.iter("testcase")
            if case.find("failure") is not None or case.find("error") is not None
        ]
    return {"ran": True, **counts, "failed": failed}


def _graphs(out: Path) -> dict:
    """Whether each figure came from graph replays or eager steps."""
    step = _get(_load(out / "gpu_step.json"), "results.decode") or {}
    found: dict[str, Any] = {"gpu_step": {case: r.get("mode") for case, r in step.items()}}
    for name in ("gpu_e2e", "gpu_e2e_large"):
        engines = _get(_load(out / f"{name}.json"), "workload.engines") or []
        found[name] = {e.get("variant"): e.get("cuda_graphs") for e in engines}
    return found


def summarize(out: Path, stages: list[dict]) -> dict:
    rows = []
    for label, file, key, op, target in TARGETS:
        value = _get(_load(out / file), key)
        met = None if not isinstance(value, (int, float)) else _COMPARE[op](value, target)
        rows.append({"target": label, "key": f"{file}:{key}", "value": value, "wanted": f"{op} {target}", "met": met})
    e2e = {name: _load(out / f"{name}.json") for name in ("gpu_e2e", "gpu_e2e_large")}
    step = _load(out / "gpu_step.json") or {}
    preflight = _load(out / "preflight.json") or {}
    return {
        "gpu": _get(preflight, "gpu.name") or _get(step, "machine.gpu"),
        "stages": stages,
        "stages_s": sum(s["seconds"] for s in stages),
        "preflight": {name: check.get("ok") for name, check in preflight.items()},
        "targets": rows,
        "tests": _tests(out),
        "graphs": _graphs(out),
        "blocking_syncs_per_step": {
            case: r.get("blocking_syncs_per_step") for case, r in (_get(step, "results.decode") or {}).items()
        },  # fmt: skip
        "tokens_match_hf_generate": {
            name: {
                variant: r.get("tokens_match_hf_generate")
                for variant, r in (_get(data, "results") or {}).items()
                if isinstance(r, dict) and "tokens_match_hf_generate" in r
            }
            for name, data in e2e.items()
        },
        "families": _load(out / "families.json"),
    }


def print_table(summary: dict) -> None:
    print(f"GPU: {summary['gpu']}")
    print(f"{'stage':<10} {'seconds':>7} {'cap':>5}  outcome")
    for s in summary["stages"]:
        print(f"{s['stage']:<10} {s['seconds']:>7} {s['cap_s']:>5}  {s['outcome']}")
    print(f"stages took {summary['stages_s']} s; preflight: {summary['preflight']}")
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
    print(f"graphed or eager: {summary['graphs']}")
    print(f"blocking syncs per decode step: {summary['blocking_syncs_per_step']}")
    print(f"tokens match generate: {summary['tokens_match_hf_generate']}")
    print(f"families (identical of prompts): {summary['families']}")


def main(argv: list[str]) -> int:
    out = Path(argv[0])
    stages = (_load(out / "summary.json") or {}).get("stages", [])
    if len(argv) > 1 and argv[1] == "--stage":
        row = stage_row(*argv[2:7])
        stages = [s for s in stages if s["stage"] != row["stage"]] + [row]  # a rerun replaces its row
        merge_junit(out, Path(os.environ.get("KVD_GPU_WORK", "/tmp/kvd-gpu-run")))
        print(f"--- {row['stage']}: {row['outcome']} after {row['seconds']} s (cap {row['cap_s']} s)")
    summary = summarize(out, stages)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    if len(argv) == 1:
        print_table(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
