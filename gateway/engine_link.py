"""The gateway's connection to an engine, and how engine errors reach clients."""

from __future__ import annotations

import threading

import grpc

from kvd_api.engine.v1 import engine_pb2 as epb
from kvd_api.engine.v1 import engine_pb2_grpc as epb_grpc

# Engine statuses a client can act on as they are; any other engine failure
# means the engine could not serve the call.
_PASSED_ON = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.UNAVAILABLE,
    }
)


# NOTE: gRPC's default reconnect backoff grows to two minutes: an engine that
# restarted would stay unreachable through this channel long after it serves.
_RECONNECT = [
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


class EngineLink:
    """One engine: its stub, and its model info once it answered.

    Args:
        address: ``HOST:PORT`` of the engine's gRPC server.
        rpc_timeout_s: the limit on unary calls (Tokenize, Info, Unpin);
            Warm and Generate get the caller's deadline.
    """

    def __init__(self, address: str, rpc_timeout_s: float = 10.0) -> None:
        self.address = address
        self.rpc_timeout_s = rpc_timeout_s
        self.channel = grpc.insecure_channel(address, options=_RECONNECT)
        self.stub = epb_grpc.EngineStub(self.channel)
        self._info: epb.InfoResponse | None = None
        self._lock = threading.Lock()

    def info(self, timeout_s: float | None = None) -> epb.InfoResponse:
        """Asks the engine (raises grpc.RpcError) and remembers the answer."""
        info = self.stub.Info(epb.InfoRequest(), timeout=timeout_s or self.rpc_timeout_s)
        with self._lock:
            self._info = info
        return info

    def model_info(self) -> epb.InfoResponse:
        """The last answer, or a fresh one when there is none yet."""
        with self._lock:
            known = self._info
        return known if known is not None and known.block_size else self.info()

    def tokenize(self, request: epb.TokenizeRequest) -> list[int]:
        return list(self.stub.Tokenize(request, timeout=self.rpc_timeout_s).token_ids)

    def close(self) -> None:
        self.channel.close()

    def error(self, err: grpc.RpcError) -> tuple[grpc.StatusCode, str]:
        return engine_error(err, f"the engine at {self.address}")


# gRPC reports a call without a deadline as ~2**63 ns remaining; passed on as
# a timeout that overflows into an immediate DEADLINE_EXCEEDED. Anything past a
# year is taken for "no deadline".
_NO_DEADLINE_S = 365 * 24 * 3600.0


def remaining_s(context: grpc.ServicerContext, default_s: float | None = None) -> float | None:
    """The timeout of an engine call made for ``context``'s caller: what is left
    of its deadline, or ``default_s`` when the caller set none (most clients'
    default, grpcurl's included)."""
    left = context.time_remaining()
    if left is None or left > _NO_DEADLINE_S:
        return default_s
    return left


def engine_error(err: grpc.RpcError, who: str = "an engine replica") -> tuple[grpc.StatusCode, str]:
    """The status and message a client gets for an engine's error."""
    code = err.code()
    if code == grpc.StatusCode.UNAVAILABLE:
        return code, f"{who} is unavailable: {err.details()}"
    if code in _PASSED_ON:
        return code, err.details() or code.name
    return grpc.StatusCode.UNAVAILABLE, f"{who} failed: {code.name}: {err.details()}"
