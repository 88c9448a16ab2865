"""What every benchmark shares, so that each script is its workload and its table.

- ``handles``: the stack's processes (daemon, engine, gateway) as context
  managers; the tests build their fixtures from the same handles (tests/conftest.py).
- ``processes``: the steps beneath them (commands, spawn, wait, stop).
- ``skeleton``: the shape of a script (``parser``'s shared flags, ``turn_order``,
  ``workdir``, ``main``: measure, report, table, verdict).
- ``streams``: one Generate call to an engine, timed as its client sees it.
- ``text``: seeded English-like prose, and texts of an exact token count.
- ``stats``: medians, percentiles, ratios, rounding.
- ``report``: the machine and code measured, the JSON, the table, progress, plots.

A script in ``benchmarks/`` imports it as ``import harness`` (Python puts a
script's folder first on ``sys.path``) and finds the common names here.
"""

from .handles import ChildProcess, DaemonProcess, EngineProcess, GatewayProcess, RedisProcess
from .processes import free_port, process_cpu_s, wait_for, wait_serving
from .report import (
    REPO_ROOT,
    ROUTER_SOURCES,
    STACK_SOURCES,
    Progress,
    bar_chart,
    format_table,
    log,
    machine_info,
    source_digest,
    stack_report,
    write_json,
)
from .skeleton import main, parser, turn_order, workdir
from .stats import mean, median, percentile, ratio, rounded

__all__ = [
    "REPO_ROOT",
    "ROUTER_SOURCES",
    "STACK_SOURCES",
    "ChildProcess",
    "DaemonProcess",
    "EngineProcess",
    "GatewayProcess",
    "Progress",
    "RedisProcess",
    "bar_chart",
    "format_table",
    "free_port",
    "log",
    "machine_info",
    "main",
    "mean",
    "median",
    "parser",
    "percentile",
    "process_cpu_s",
    "ratio",
    "rounded",
    "source_digest",
    "stack_report",
    "turn_order",
    "wait_for",
    "wait_serving",
    "workdir",
    "write_json",
]
