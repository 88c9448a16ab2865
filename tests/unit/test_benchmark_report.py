"""What every benchmark writes survives what a GPU machine may lack or measure
wrongly: no git binary, a NaN from a broken kernel."""

from __future__ import annotations

import json

from benchmarks.harness import report


def test_a_nan_or_infinity_is_written_as_null_and_the_other_figures_stay(tmp_path):
    path = tmp_path / "out.json"
    report.write_json(path, {"ratios": {"broken": float("nan"), "ok": 1.5}, "list": [float("inf"), 2]})
    assert json.loads(path.read_text()) == {"ratios": {"broken": None, "ok": 1.5}, "list": [None, 2]}


def test_the_source_digest_is_written_without_git(monkeypatch, tmp_path):
    with_git = report.source_digest()
    monkeypatch.setenv("PATH", str(tmp_path))  # no git to be found
    without = report.source_digest()
    assert without["git_head"] is None
    assert without["sha256"] == with_git["sha256"] and without["files"] == with_git["files"] > 0
