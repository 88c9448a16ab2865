"""`kvd-health`: exits 0 iff a gRPC server reports SERVING (grpc.health.v1).

    kvd-health ADDRESS [--service NAME] [--timeout S]

ADDRESS is ``unix:PATH`` or ``HOST:PORT``. Container healthchecks and
Kubernetes exec probes run it; it needs nothing beyond the installed package.
Exit codes: 0 SERVING, 1 any other status, 2 unreachable or an RPC error.
"""

from __future__ import annotations

import sys

import click
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvd.common.settings import Setting, SettingsCommand, parse

COMMAND = SettingsCommand(
    "kvd-health",
    help=__doc__.splitlines()[0] + " ADDRESS: unix:PATH or HOST:PORT.",
    params=[
        click.Argument(["address"]),
        Setting("--service", help="service name to ask about; empty: the whole server"),
        Setting("--timeout", type=click.FLOAT, default=3.0, help="seconds to wait for the answer"),
    ],
)


def check(address: str, service: str = "", timeout_s: float = 3.0) -> tuple[int, str]:
    """Asks ``address`` for the health of ``service``: (exit code, what to print)."""
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
        except grpc.RpcError as exc:
            return 2, f"{address}: {exc.code().name}: {exc.details()}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return (0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1), f"{address}: {status}"


def main(argv: list[str] | None = None) -> int:
    args = parse(COMMAND, argv)
    code, message = check(args.address, args.service, args.timeout)
    print(message, file=sys.stdout if code == 0 else sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
