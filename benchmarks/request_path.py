"""Which project files one Generate request passes through, gateway -> engine -> daemon and back.

Starts `kvd-serve` (daemon, engine, gateway on their defaults, private socket
and ports) with a profiling hook in every child: a `sitecustomize` module that
records the source file of every Python function called while a marker file
exists. One warm-up Generate, then the marker is created, one Generate of
4 new tokens runs, the marker is removed and each process writes what it saw.
Counted: files inside this repository (the generated protobuf package
included, as the code a request runs through). Background work that happens
in the same window (lease heartbeats, health checks) is counted too: it is
what a process does while serving.

    .venv/bin/python benchmarks/request_path.py --json FILE
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _common as common

from gateway.client import GatewayClient

ROOT = Path(__file__).resolve().parent.parent

# Runs at interpreter start in every child (PYTHONPATH puts its folder first).
SITECUSTOMIZE = '''
import os, sys, threading, time
_out = os.environ.get("KVD_TRACE_OUT")
if _out:
    _marker, _root = os.environ["KVD_TRACE_MARKER"], os.environ["KVD_TRACE_ROOT"]
    _seen, _active = set(), [False]

    def _profile(frame, event, arg):
        if _active[0] and event == "call":
            _seen.add(frame.f_code.co_filename)

    def _watch():
        while True:
            on = os.path.exists(_marker)
            if on and not _active[0]:
                _seen.clear()
                _active[0] = True
            elif not on and _active[0]:
                _active[0] = False
                files = sorted(f for f in _seen if f.startswith(_root) and "/.venv/" not in f)
                with open(f"{_out}.{os.getpid()}", "w") as fh:
                    fh.write("\\n".join([" ".join(sys.argv)] + files))
            time.sleep(0.02)

    sys.setprofile(_profile)
    threading.setprofile(_profile)
    threading.Thread(target=_watch, daemon=True, name="trace-watch").start()
'''


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


def trace(work: Path) -> dict[str, list[str]]:
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
    per_process: dict[str, list[str]] = {}
    for path in sorted(work.glob("files.*")):
        argv, *files = path.read_text().splitlines()
        name = next((m for m in ("gateway.cli", "inference.cli", "kvd.cli", "inference.stack") if m in argv), argv)
        per_process[name] = [str(Path(f).relative_to(ROOT)) for f in files]
    return per_process


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvd-path-") as tmp:
        per_process = trace(Path(tmp))
    union = sorted({f for files in per_process.values() for f in files})
    own = [f for f in union if not f.startswith("protos/")]
    results = {
        "per_process": {name: {"files": len(files), "paths": files} for name, files in per_process.items()},
        "files": len(union),
        "project_files_excluding_generated": len(own),
        "paths": union,
    }
    common.write_json(
        args.json,
        {
            "benchmark": "request_path",
            "quick": False,
            "machine": common.machine_info(),
            "workload": {"request": "one Generate through kvd-serve, 4 new tokens, after two warm-ups"},
            "results": results,
            "ratios": {},
        },
    )
    print(f"{len(union)} files ({len(own)} without generated protobuf code):")
    for f in union:
        print("  ", f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
