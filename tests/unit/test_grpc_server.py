"""The shared server builder: statuses by table, health, reflection, graceful stop (a real server on localhost)."""

from __future__ import annotations

import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvd.common.field_error import FieldError, field_of
from kvd.common.grpc_server import CallLimit, OpenCalls, build_server


class Refused(Exception):
    pass


TABLE = (
    (KeyError, grpc.StatusCode.NOT_FOUND),
    (Refused, lambda exc: (grpc.StatusCode.RESOURCE_EXHAUSTED, f"refused: {exc}")),
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
)
_BYTES = {"request_deserializer": None, "response_serializer": None}


def _raise(request: bytes, context):
    kind = request.decode()
    if kind == "value":
        raise ValueError("count: must be > 0")
    if kind == "field":
        raise FieldError("sampling.top_p", "sampling.top_p must be in (0, 1], got 2.0")
    if kind == "refused":
        raise Refused("over the cap")
    if kind == "abort":
        context.abort(grpc.StatusCode.PERMISSION_DENIED, "not yours")
    if kind == "bug":
        raise RuntimeError("a bug")
    return b"ok"


def _stream(request: bytes, context):
    yield b"first"
    _raise(request, context)


def _add(_servicer, server: grpc.Server) -> None:
    handlers = {
        "Unary": grpc.unary_unary_rpc_method_handler(_raise, **_BYTES),
        "Stream": grpc.unary_stream_rpc_method_handler(_stream, **_BYTES),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Raiser", handlers),))


@pytest.fixture(scope="module")
def served():
    server = build_server([(_add, None, "test.Raiser")], TABLE, serving=False, max_workers=4, thread_name_prefix="t")
    port = server.add_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield server, channel
    channel.close()
    server.stop(grace_s=0)


def _status(channel, method: str, kind: str) -> tuple[grpc.StatusCode, str]:
    """The status a call ends with (a stream ends with it after its first message)."""
    try:
        if method == "Unary":
            channel.unary_unary("/test.Raiser/Unary")(kind.encode(), timeout=10)
        else:
            replies = channel.unary_stream("/test.Raiser/Stream")(kind.encode(), timeout=10)
            assert next(replies) == b"first"
            list(replies)
    except grpc.RpcError as err:
        return err.code(), err.details()
    return grpc.StatusCode.OK, ""


@pytest.mark.parametrize("method", ["Unary", "Stream"])
def test_exceptions_become_the_tables_statuses(served, method):
    _, channel = served
    assert _status(channel, method, "value") == (grpc.StatusCode.INVALID_ARGUMENT, "count: must be > 0")
    assert _status(channel, method, "refused") == (grpc.StatusCode.RESOURCE_EXHAUSTED, "refused: over the cap")
    assert _status(channel, method, "abort") == (grpc.StatusCode.PERMISSION_DENIED, "not yours")
    code, message = _status(channel, method, "bug")
    assert code == grpc.StatusCode.INTERNAL and message == f"internal error in {method}; see the server's log"


def test_health_follows_set_serving_for_the_service_and_the_server(served):
    server, channel = served
    stub = health_pb2_grpc.HealthStub(channel)

    def statuses():
        return {stub.Check(health_pb2.HealthCheckRequest(service=name)).status for name in ("", "test.Raiser")}

    assert statuses() == {health_pb2.HealthCheckResponse.NOT_SERVING}
    server.set_serving(True)
    assert statuses() == {health_pb2.HealthCheckResponse.SERVING}
    server.set_serving(False)


def test_reflection_lists_the_services(served):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    _, channel = served
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    reply = next(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    names = {s.name for s in reply.list_services_response.service}
    assert {"test.Raiser", "grpc.health.v1.Health"} <= names


def test_stop_reports_not_serving_and_refuses_new_calls():
    server = build_server([(_add, None, "test.Raiser")], TABLE, serving=True, max_workers=2, thread_name_prefix="t")
    port = server.add_port("127.0.0.1:0")
    server.start()
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        assert channel.unary_unary("/test.Raiser/Unary")(b"fine", timeout=10) == b"ok"
        server.stop(grace_s=0.1)
        assert server.health.Check(health_pb2.HealthCheckRequest(service=""), None).status == (
            health_pb2.HealthCheckResponse.NOT_SERVING
        )
        with pytest.raises(grpc.RpcError) as err:
            channel.unary_unary("/test.Raiser/Unary")(b"fine", timeout=2)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def _endless(request: bytes, context):
    """A generation that never ends (until its client leaves)."""
    while context.is_active():
        yield b"token"
        time.sleep(0.01)


def _add_endless(_servicer, server: grpc.Server) -> None:
    handlers = {"Generate": grpc.unary_stream_rpc_method_handler(_endless, **_BYTES)}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Endless", handlers),))


def test_long_calls_past_the_limit_are_refused_at_once_while_other_calls_are_served():
    server = build_server(
        [(_add_endless, None, "test.Endless")], TABLE, serving=True, max_workers=2, thread_name_prefix="t",
        long_calls=CallLimit(frozenset({"Generate"}), OpenCalls(3, "--max-open-requests")),
    )  # fmt: skip
    port = server.add_port("127.0.0.1:0")
    server.start()
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        generate = channel.unary_stream("/test.Endless/Generate")
        streams = [generate(b"", timeout=30) for _ in range(3)]
        assert [next(s) for s in streams] == [b"token"] * 3
        # The fourth is refused at once, not queued behind three endless streams.
        with pytest.raises(grpc.RpcError) as err:
            next(generate(b"", timeout=10))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "3 requests are open here (--max-open-requests)" in err.value.details()
        # Health is served from the threads besides the limit's.
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        # A stream its client cancels gives its place back.
        streams[0].cancel()
        deadline = time.monotonic() + 10
        while True:
            try:
                assert next(generate(b"", timeout=10)) == b"token"
                break
            except grpc.RpcError as refused:
                assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert time.monotonic() < deadline, "the cancelled stream kept its place"
        for s in streams[1:]:
            s.cancel()
    server.stop(grace_s=0)


def test_a_limit_below_one_is_refused():
    with pytest.raises(ValueError, match="--max-open-requests must be >= 1, got 0"):
        OpenCalls(0, "--max-open-requests")


@pytest.mark.parametrize("method", ["Unary", "Stream"])
def test_a_refused_field_is_named_beside_the_status(served, method):
    """A caller in another process learns the field from the trailing metadata, not the message."""
    _, channel = served
    with pytest.raises(grpc.RpcError) as refused:
        if method == "Unary":
            channel.unary_unary("/test.Raiser/Unary")(b"field", timeout=10)
        else:
            list(channel.unary_stream("/test.Raiser/Stream")(b"field", timeout=10))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details() == "sampling.top_p must be in (0, 1], got 2.0"
    assert field_of(refused.value) == "sampling.top_p"


def test_a_plain_value_error_names_no_field(served):
    _, channel = served
    with pytest.raises(grpc.RpcError) as refused:
        channel.unary_unary("/test.Raiser/Unary")(b"value", timeout=10)
    assert field_of(refused.value) is None


def test_a_field_within_a_message_is_prefixed_by_it():
    inner = FieldError("top_p", "top_p must be in (0, 1], got 2.0")
    outer = inner.within("sampling")
    assert (outer.field, str(outer)) == ("sampling.top_p", "sampling.top_p must be in (0, 1], got 2.0")
    assert isinstance(outer, ValueError)
