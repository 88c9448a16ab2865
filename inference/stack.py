"""`kvd-serve`: the whole stack on its defaults, as child processes.

Starts the daemon, the engine and the gateway, prints where to reach them,
stops all of them on Ctrl-C, and if one dies, stops the others with a message
naming it. Each child keeps its own flags and environment variables; this only
supervises (it reads the addresses it passes on: its own settings, in ``COMMAND``).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from types import SimpleNamespace

from kvd.cli import SOCKET
from kvd.settings import Setting, SettingsCommand, parse

COMMAND = SettingsCommand(
    "kvd-serve",
    help=__doc__.splitlines()[0],
    params=[
        Setting("--engine", env="KVD_ENGINE_ADDR", default="127.0.0.1:50052", help="engine address"),
        Setting("--gateway", env="KVD_GATEWAY_ADDR", default="127.0.0.1:50051", help="the public gateway's address"),
        SOCKET,  # the daemon's own: kvd-serve hands it to the daemon and the engine
    ],
)


def _children(args: SimpleNamespace) -> list[tuple[str, list[str]]]:
    python = sys.executable
    socket_path = args.socket
    return [
        ("kvd", [python, "-m", "kvd.cli", "--socket", socket_path]),
        ("engine", [python, "-m", "inference.cli", "--kvd-address", f"unix:{socket_path}", "--listen", args.engine]),
        ("gateway", [python, "-m", "gateway.cli", "--listen", args.gateway, "--engines", args.engine]),
    ]


def main(argv: list[str] | None = None) -> int:
    args = parse(COMMAND, argv)
    procs: dict[str, subprocess.Popen] = {}
    stopping = False

    def stop(*_):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    for name, cmd in _children(args):
        procs[name] = subprocess.Popen(cmd)
    print(
        f"kvd-serve: gateway on {args.gateway} (gRPC, the public API); engine on {args.engine}; "
        "Ctrl-C stops everything",
        flush=True,
    )
    code = 0
    while not stopping:
        for name, proc in procs.items():
            if proc.poll() is not None:
                print(f"kvd-serve: {name} exited with code {proc.returncode}; stopping the others", file=sys.stderr)
                stopping, code = True, 1
                break
        time.sleep(0.2)
    _stop_all(procs)
    return code


def _stop_all(procs: dict[str, subprocess.Popen]) -> None:
    # The gateway first, then the engine, then the daemon it is attached to.
    for proc in reversed(list(procs.values())):
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs.values():
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()


if __name__ == "__main__":
    sys.exit(main())
