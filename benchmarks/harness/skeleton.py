"""The shape every benchmark script shares, for each to fill with its workload and its table.

A script declares its flags on ``parser`` (which gives the shared ``--json``
and ``--quick``), measures in a folder of ``workdir``, alternates its variants
with ``turn_order``, and hands the rest to ``main``::

    def main(argv=None) -> int:
        return harness.main(
            parse_args(argv),
            measure=run,             # (args, folder) -> what it measured
            report=report,           # (args, measured) -> the JSON (report.stack_report's shape)
            table=table,             # (the JSON) -> the text printed
            verdict=failed_requests, # (args, the JSON) -> the exit status (default 0)
        )
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

from .report import write_json

T = TypeVar("T")

Report = dict[str, Any]


def parser(doc: str | None, quick_help: str | None = "a small workload (about a minute)") -> argparse.ArgumentParser:
    """An argument parser described by the first paragraph of ``doc`` (the script's
    docstring), with the flags every benchmark takes: ``--json``, ``--quick``
    (left out when ``quick_help`` is None: a script with no smaller workload)."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0] if doc else None)
    p.add_argument("--json", required=True, help="write the results here")
    if quick_help is not None:
        p.add_argument("--quick", action="store_true", help=quick_help)
    return p


def turn_order(variants: Sequence[T], turn: int) -> list[T]:
    """The variants in turn ``turn``'s order: forward on even turns, backward on
    odd ones, so a machine's drift and a warm-up fall on each variant alike."""
    return list(variants) if turn % 2 == 0 else list(reversed(variants))


@contextlib.contextmanager
def workdir(prefix: str = "kvd-bench-", keep: str | None = None) -> Iterator[Path]:
    """A fresh folder for the processes' sockets and logs, removed after; or
    ``keep``, made if needed and kept (its logs stay to read).

    NOTE: under /tmp, not pytest's or the user's temp dir: unix socket paths
    are limited to about 107 bytes.
    """
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        yield Path(keep)
        return
    folder = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
    try:
        yield Path(folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def main(
    args: argparse.Namespace,
    *,
    measure: Callable[[argparse.Namespace, Path], Any],
    report: Callable[[argparse.Namespace, Any], Report],
    table: Callable[[Report], str],
    verdict: Callable[[argparse.Namespace, Report], int] = lambda _args, _report: 0,
    workdir_prefix: str = "kvd-bench-",
) -> int:
    """Measures in a fresh folder (``args.workdir`` when the script has that
    flag and it is set), writes the report to ``args.json``, prints its table;
    returns the verdict's exit status."""
    with workdir(workdir_prefix, getattr(args, "workdir", None)) as folder:
        measured = measure(args, folder)
    out = report(args, measured)
    write_json(args.json, out)
    print(table(out))
    return verdict(args, out)
