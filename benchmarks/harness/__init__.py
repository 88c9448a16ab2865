"""What every benchmark shares, so that each script is its workload and its table.

- ``processes``: starting the stack (daemon, engine, gateway subprocesses);
  the tests start theirs with the same commands and waits (tests/conftest.py).
- ``streams``: one Generate call to an engine, timed as its client sees it.
- ``text``: seeded English-like prose, and texts of an exact token count.
- ``stats``: medians, percentiles, ratios, rounding.
- ``report``: the machine and code measured, the JSON, the table, progress, plots.

A script in ``benchmarks/`` imports it as ``import harness`` (Python puts a
script's folder first on ``sys.path``) and finds the common names here.
"""

from .processes import (
    ChildProcess,
    EngineProcess,
    GatewayProcess,
    KvdProcess,
    free_port,
    process_cpu_s,
    wait_serving,
)
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
from .stats import mean, median, percentile, ratio, rounded

__all__ = [
    "REPO_ROOT",
    "ROUTER_SOURCES",
    "STACK_SOURCES",
    "ChildProcess",
    "EngineProcess",
    "GatewayProcess",
    "KvdProcess",
    "Progress",
    "bar_chart",
    "format_table",
    "free_port",
    "log",
    "machine_info",
    "mean",
    "median",
    "percentile",
    "process_cpu_s",
    "ratio",
    "rounded",
    "source_digest",
    "stack_report",
    "wait_serving",
    "write_json",
]
