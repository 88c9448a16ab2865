"""`kvd-serve`: the whole stack on its defaults, as child processes.

Starts the daemon, ``--engines`` engines sharing it (one daemon session each:
a prefix one computed is a hit for all) and the gateway in front of them,
prints where to reach them, stops all of them on Ctrl-C, and if one dies,
stops the others with a message naming it. Each child keeps its own flags
and environment variables; this only supervises (it reads the addresses it
passes on: its own settings, in ``COMMAND``).

SIGHUP replaces the engines one at a time (an upgrade, a new model file of
the same model): each is drained (SIGTERM: it stops taking requests, hands
back those that streamed nothing yet, finishes the others, detaches) and
started again on its address, and the next waits until it serves. No
request is lost (the gateway retries a refused one on another replica, or
holds it until one serves again: docs/deploy.md) and nothing is recomputed:
the daemon's cache, and every prefix in it, outlives each engine. The
children get SIGTERM if kvd-serve dies, even killed outright.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import click
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.config import GatewaySettings
from kvd.common.children import stop_with_parent
from kvd.common.config_fields import setting_of
from kvd.common.defaults import ENGINE_ADDRESS, GATEWAY_ADDRESS
from kvd.common.settings import SOCKET, Setting, SettingsCommand, parse

COMMAND = SettingsCommand(
    "kvd-serve",
    help=__doc__.splitlines()[0],
    params=[
        Setting(
            "--engine",
            env="KVD_ENGINE_ADDR",
            default=ENGINE_ADDRESS,
            help="the first engine's address (the others take the next ports)",
        ),
        Setting(
            "--engines",
            "num_engines",
            env="KVD_SERVE_ENGINES",
            type=click.IntRange(min=1),
            default=1,
            help="engine processes sharing the daemon's cache (SIGHUP replaces them one at a time)",
        ),
        Setting("--gateway", env="KVD_GATEWAY_ADDR", default=GATEWAY_ADDRESS, help="the public gateway's address"),
        setting_of(GatewaySettings, "http_listen"),  # the gateway's own: kvd-serve passes it on
        SOCKET,  # the daemon's own: kvd-serve hands it to the daemon and the engines
    ],
)

#: How long a replaced engine may take to come back and serve (model load included).
ENGINE_START_S = 300.0


def engine_addresses(first: str, count: int) -> list[str]:
    """``count`` engine addresses: ``first``, then the ports after it."""
    host, _, port = first.rpartition(":")
    return [f"{host}:{int(port) + i}" for i in range(count)]


class Stack:
    """The children, by name: ``kvd``, ``engine-0``..., ``gateway``."""

    def __init__(self, args: SimpleNamespace) -> None:
        python = sys.executable
        self.engines = engine_addresses(args.engine, args.num_engines)
        self.commands = {"kvd": [python, "-m", "kvd.cli", "--socket", args.socket]}
        for i, address in enumerate(self.engines):
            self.commands[f"engine-{i}"] = [
                python, "-m", "inference.cli", "--kvd-address", f"unix:{args.socket}", "--listen", address,
            ]  # fmt: skip
        self.commands["gateway"] = [
            python, "-m", "gateway.cli", "--listen", args.gateway, "--engines", ",".join(self.engines),
            "--http-listen", args.http_listen,
        ]  # fmt: skip
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self) -> None:
        for name in self.commands:
            self._start(name)

    def _start(self, name: str) -> None:
        self.procs[name] = subprocess.Popen(self.commands[name], preexec_fn=stop_with_parent)

    def dead(self) -> tuple[str, int] | None:
        """A child that exited, and its code (None: all run)."""
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                return name, proc.returncode
        return None

    def replace_engines(self) -> None:
        """Drains and restarts each engine in turn (see the module's docstring)."""
        for i, address in enumerate(self.engines):
            name = f"engine-{i}"
            print(f"kvd-serve: replacing {name} ({address}): draining it", flush=True)
            old = self.procs[name]
            old.send_signal(signal.SIGTERM)
            old.wait()
            self._start(name)
            if not wait_serving(address, self.procs[name], ENGINE_START_S):
                print(f"kvd-serve: {name} did not come back; the rolling replacement stops", file=sys.stderr)
                return
            print(f"kvd-serve: {name} serves again", flush=True)

    def stop(self) -> None:
        # The gateway first, then the engines, then the daemon they are attached to.
        for proc in reversed(list(self.procs.values())):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=45)  # an engine drains: its running requests finish first
            except subprocess.TimeoutExpired:
                proc.kill()


def wait_serving(address: str, proc: subprocess.Popen, timeout_s: float) -> bool:
    """Whether the gRPC server at ``address`` reports SERVING before ``timeout_s`` (False if ``proc`` exits)."""
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if health.Check(health_pb2.HealthCheckRequest(), timeout=1.0).status == 1:
                    return True
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    return False


def main(argv: list[str] | None = None) -> int:
    args = parse(COMMAND, argv)
    stack = Stack(args)
    state = {"stopping": False, "replace": False}
    signal.signal(signal.SIGINT, lambda *_: state.update(stopping=True))
    signal.signal(signal.SIGTERM, lambda *_: state.update(stopping=True))
    signal.signal(signal.SIGHUP, lambda *_: state.update(replace=True))
    stack.start()
    engines = ", ".join(stack.engines)
    http = f", http://{args.http_listen}/v1 (OpenAI-compatible HTTP)" if args.http_listen else ""
    print(
        f"kvd-serve: gateway on {args.gateway} (gRPC, the public API){http}; engines on {engines}; "
        "Ctrl-C stops everything; SIGHUP replaces the engines one at a time",
        flush=True,
    )
    code = 0
    while not state["stopping"]:
        if state["replace"]:
            state["replace"] = False
            stack.replace_engines()
        if (dead := stack.dead()) is not None:
            print(f"kvd-serve: {dead[0]} exited with code {dead[1]}; stopping the others", file=sys.stderr)
            code = 1
            break
        time.sleep(0.2)
    stack.stop()
    return code


if __name__ == "__main__":
    sys.exit(main())
