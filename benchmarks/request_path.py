"""Which project files one Generate request passes through, gateway -> engine -> daemon and back.

Starts `kvd-serve` (daemon, engine, gateway on their defaults, private socket
and ports) with a profiling hook in every child: a `sitecustomize` module that
records the source file of every Python function called while a marker file
exists. One warm-up Generate, then the marker is created, one Generate of
4 new tokens runs, the marker is removed and each process writes what it saw.
Counted: files inside this repository (the generated protobuf package
included, as the code a request runs through), each with the thread that ran
it. ``request_path`` is what the request's own threads ran (gRPC handlers, the
engine's loop, the daemon's offload copier): what a reader follows from
Generate to the last token. ``files`` adds what the timer and watcher threads
ran in the same window (lease reaper and heartbeats, health checks, the
template keeper, the gateway's block-event and load watchers): what a process
does while serving, whether or not this request caused it.

    .venv/bin/python benchmarks/request_path.py --json FILE
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import harness

from gateway.client import GatewayClient

ROOT = Path(__file__).resolve().parent.parent

# Runs at interpreter start in every child (PYTHONPATH puts its folder first).
SITECUSTOMIZE = """
import os, sys, threading, time
_out = os.environ.get("KVD_TRACE_OUT")
if _out:
    _marker, _root = os.environ["KVD_TRACE_MARKER"], os.environ["KVD_TRACE_ROOT"]
    _seen, _active = set(), [False]

    def _profile(frame, event, arg):
        if _active[0] and event == "call":
            _seen.add((threading.current_thread().name, frame.f_code.co_filename))

    def _watch():
        while True:
            on = os.path.exists(_marker)
            if on and not _active[0]:
                _seen.clear()
                _active[0] = True
            elif not on and _active[0]:
                _active[0] = False
                seen = sorted(f"{t}\\t{f}" for t, f in _seen if f.startswith(_root) and "/.venv/" not in f)
                with open(f"{_out}.{os.getpid()}", "w") as fh:
                    fh.write("\\n".join([" ".join(sys.argv)] + seen))
            time.sleep(0.02)

    sys.setprofile(_profile)
    threading.setprofile(_profile)
    threading.Thread(target=_watch, daemon=True, name="trace-watch").start()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(address: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    with GatewayClient(address, timeout_s=10) as client:
        while True:
            try:
                list(client.generate("warm-up", max_new_tokens=1))
                return
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(1.0)


#: Threads that run on timers or watch streams, not for one request (their names in the code).
BACKGROUND_THREADS = ("kvd-reaper", "kvd-heartbeat", "replica-monitor", "template-keeper", "events-", "load-",
                      "trace-watch")  # fmt: skip


def trace(work: Path) -> dict[str, dict[str, list[str]]]:
    hook = work / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SITECUSTOMIZE)
    marker, out = work / "tracing", work / "files"
    gateway, engine = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(hook), str(ROOT), str(ROOT / "protos"), os.environ.get("PYTHONPATH", "")]),
        KVD_TRACE_OUT=str(out),
        KVD_TRACE_MARKER=str(marker),
        KVD_TRACE_ROOT=str(ROOT),
        KVD_SOCKET=str(work / "kvd.sock"),
    )
    cmd = [sys.executable, "-m", "inference.stack", "--gateway", gateway, "--engine", engine]
    with open(work / "serve.log", "w") as log:
        serve = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=log)
    try:
        wait_ready(gateway, timeout_s=300)
        with GatewayClient(gateway, timeout_s=60) as client:
            list(client.generate("The capital of France is", max_new_tokens=4))  # second warm-up
            marker.touch()
            time.sleep(0.1)
            chunks = list(client.generate("The capital of France is", max_new_tokens=4))
            marker.unlink()
        assert chunks, "the traced Generate returned nothing"
        time.sleep(0.5)
    finally:
        serve.send_signal(signal.SIGINT)
        serve.wait(timeout=60)
    per_process: dict[str, dict[str, list[str]]] = {}
    for path in sorted(work.glob("files.*")):
        argv, *lines = path.read_text().splitlines()
        name = next((m for m in ("gateway.cli", "inference.cli", "kvd.cli", "inference.stack") if m in argv), argv)
        split: dict[str, set[str]] = {"request_path": set(), "background": set()}
        for line in lines:
            thread, file = line.split("\t", 1)
            kind = "background" if thread.startswith(BACKGROUND_THREADS) else "request_path"
            split[kind].add(str(Path(file).relative_to(ROOT)))
        per_process[name] = {kind: sorted(files) for kind, files in split.items()}
    return per_process


def report(_args: argparse.Namespace, per_process: dict[str, dict[str, list[str]]]) -> dict[str, Any]:
    union = sorted({f for split in per_process.values() for files in split.values() for f in files})
    own = [f for f in union if not f.startswith("protos/")]
    on_path = sorted({f for split in per_process.values() for f in split["request_path"]})
    results = {
        "per_process": {
            name: {"files": len(set(split["request_path"]) | set(split["background"])), **split}
            for name, split in per_process.items()
        },
        "files": len(union),
        "project_files_excluding_generated": len(own),
        "paths": union,
        "request_path_files": len(on_path),
        "request_path": on_path,
    }
    return {
        "benchmark": "request_path",
        "quick": False,
        "machine": harness.machine_info(),
        "workload": {"request": "one Generate through kvd-serve, 4 new tokens, after two warm-ups"},
        "results": results,
        "ratios": {},
    }


def table(report: dict[str, Any]) -> str:
    union, on_path = report["results"]["paths"], report["results"]["request_path"]
    lines = [f"{len(on_path)} files on the request's own threads; {len(union)} with background threads:"]
    lines += [f"   {f} {'' if f in on_path else '(background only)'}" for f in union]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = harness.parser(__doc__, quick_help=None).parse_args(argv)
    return harness.main(
        args, measure=lambda _args, folder: trace(folder), report=report, table=table, workdir_prefix="kvd-path-"
    )


if __name__ == "__main__":
    sys.exit(main())
