"""Engine endpoints: fixed ``HOST:PORT`` entries and ``dns:NAME:PORT`` names.

A ``dns:`` entry stands for every address its name resolves to right now (a
Kubernetes headless service lists one address per ready pod), so it is
resolved again and again as pods come and go. A name that does not resolve
contributes nothing until it does.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Sequence

DNS_PREFIX = "dns:"

Resolver = Callable[[str, int], list[str]]


def check_endpoint(entry: str) -> None:
    """Raises ValueError unless ``entry`` is ``HOST:PORT`` or ``dns:NAME:PORT``."""
    host, sep, port = entry.removeprefix(DNS_PREFIX).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"engine endpoint {entry!r}: expected HOST:PORT or dns:NAME:PORT")


def resolve_dns(name: str, port: int) -> list[str]:
    """Every TCP address ``name`` resolves to, as gRPC targets; [] if it does not resolve."""
    try:
        infos = socket.getaddrinfo(name, port, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return []
    out = []
    for family, _, _, _, sockaddr in infos:
        host = f"[{sockaddr[0]}]" if family == socket.AF_INET6 else sockaddr[0]
        out.append(f"{host}:{port}")
    return out


def expand(entries: Sequence[str], resolve: Resolver = resolve_dns) -> list[str]:
    """The engine addresses ``entries`` stand for now: sorted, without duplicates."""
    addresses: set[str] = set()
    for entry in entries:
        if entry.startswith(DNS_PREFIX):
            name, _, port = entry.removeprefix(DNS_PREFIX).rpartition(":")
            addresses.update(resolve(name, int(port)))
        else:
            addresses.add(entry)
    return sorted(addresses)
