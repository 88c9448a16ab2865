"""What a benchmark writes: which machine and code it measured, the JSON, its table, progress, a plot.

Every benchmark's JSON has the shape ``../shared/BENCHMARKS.md`` describes:
``benchmark``, ``quick``, ``machine`` (``machine_info``), the code measured
(``source_digest``), ``workload``, ``results``, ``ratios``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

#: The checkout these benchmarks belong to.
REPO_ROOT = Path(__file__).resolve().parents[2]


def machine_info() -> dict[str, Any]:
    """The machine block of every benchmark's JSON (see BENCHMARKS.md)."""
    try:
        import torch

        torch_version: str | None = torch.__version__
        device = "cuda" if torch.cuda.is_available() else "cpu"
    except ImportError:  # pragma: no cover - torch is a dependency of kvd
        torch_version, device = None, "cpu"
    return {
        "cpus": os.cpu_count(),
        "torch": torch_version,
        "device": device,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


#: The router's code: what the routing benchmarks measure.
ROUTER_SOURCES = (
    "gateway/router.py",
    "gateway/route_types.py",
    "gateway/replica_load.py",
    "gateway/placement.py",
    "gateway/policies.py",
    "gateway/block_index.py",
)


def source_digest(globs: Sequence[str] = ("kvd/**/*.py", "protos/**/*.proto")) -> dict[str, Any]:
    """Which code was measured: a sha256 over the matching files of the repository.

    The tree is often uncommitted while benchmarks run, so a commit id alone
    would not tell two runs apart.
    """
    root = REPO_ROOT
    digest = hashlib.sha256()
    files = sorted({path for pattern in globs for path in root.glob(pattern) if path.is_file()})
    for path in files:
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return {"sha256": digest.hexdigest()[:16], "files": len(files), "git_head": _git_head(root)}


def _git_head(root: Path) -> str | None:
    """The checkout's commit, or None (no git: a GPU machine's image may have none)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True)
    except OSError:
        return None
    return head.stdout.strip() or None


#: The code a whole-stack benchmark measures.
STACK_SOURCES = ("kvd/**/*.py", "inference/**/*.py", "gateway/**/*.py")


def stack_report(name: str, quick: bool, workload: dict, results: dict, ratios: dict) -> dict[str, Any]:
    """The JSON of a benchmark that measured the whole stack, in the shared shape."""
    return {
        "benchmark": name,
        "quick": quick,
        "machine": machine_info(),
        "source": source_digest(STACK_SOURCES),
        "workload": workload,
        "results": results,
        "ratios": ratios,
    }


def write_json(path: str | os.PathLike, data: dict[str, Any]) -> None:
    """Writes ``data`` as indented JSON, creating the parent folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(_finite(data), indent=2, allow_nan=False) + "\n")
    tmp.replace(path)


def _finite(value: Any) -> Any:
    """``value`` with NaN and infinities as None: JSON has no such numbers,
    and a broken measurement must not cost the file its other figures."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain-text table; floats get 4 significant digits."""

    def cell(value: Any) -> str:
        if isinstance(value, float):
            return "-" if math.isnan(value) else f"{value:.4g}"
        return "-" if value is None else str(value)

    text = [[cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in text)) for i, h in enumerate(headers)]
    line = "  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in text]
    return "\n".join(out)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class Progress:
    """A one-line progress bar on stderr (a line per phase when not a terminal)."""

    def __init__(self, label: str, total: int, width: int = 30) -> None:
        self.label = label
        self.total = max(1, total)
        self.width = width
        self.count = 0
        self.start = time.perf_counter()
        self._last = 0.0
        self._tty = sys.stderr.isatty()

    def advance(self, n: int = 1) -> None:
        self.count += n
        now = time.perf_counter()
        if self._tty and now - self._last >= 0.2:
            self._last = now
            self._draw()

    def _draw(self) -> None:
        frac = min(1.0, self.count / self.total)
        bar = "#" * int(frac * self.width)
        sys.stderr.write(f"\r{self.label:<34} [{bar:<{self.width}}] {frac:4.0%}")
        sys.stderr.flush()

    def done(self, note: str = "") -> None:
        elapsed = time.perf_counter() - self.start
        if self._tty:
            self.count = self.total
            self._draw()
            sys.stderr.write(f" {elapsed:6.2f}s {note}\n")
        else:
            sys.stderr.write(f"{self.label:<34} done {elapsed:6.2f}s {note}\n")
        sys.stderr.flush()


def bar_chart(
    path: str | os.PathLike,
    groups: Sequence[str],
    series: dict[str, Sequence[float]],
    ylabel: str,
    title: str,
) -> bool:
    """A grouped bar chart as PNG; returns False (and says so) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log(f"--plot: matplotlib is not installed; skipped {path}")
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / max(1, len(series))
    for k, (name, values) in enumerate(series.items()):
        xs = [g + (k - (len(series) - 1) / 2) * width for g in range(len(groups))]
        ax.bar(xs, values, width, label=name)
    ax.set_xticks(range(len(groups)), groups)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
