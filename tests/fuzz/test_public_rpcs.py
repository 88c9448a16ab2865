"""Hostile input: property-based requests against every RPC of the gateway, the
engine and the daemon.

Requests are drawn from each method's protobuf descriptor (so new fields are
fuzzed too): random strings and bytes, huge and negative integers, NaN and
infinite floats, unknown enum values, long repeated fields, nested messages;
Step requests name the fuzzer's own live session, other sessions' request ids
and any block id. Each answer must be OK or a documented status, never
UNKNOWN or INTERNAL; no process may die; afterwards no request holds a block.

Examples per RPC: ``KVD_FUZZ_EXAMPLES`` (default 15, a short run; e.g. 500
for a long one). Each test prints how many cases it ran.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import tempfile
from collections import Counter

import grpc
import pytest
from google.protobuf.descriptor import FieldDescriptor
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvd.common.client import DaemonClient
from kvd_api.daemon.v1 import daemon_pb2 as dpb
from kvd_api.engine.v1 import engine_pb2 as epb
from kvd_api.gateway.v1 import gateway_pb2 as gpb
from tests.conftest import SMALL_LAYOUT, start_daemon, start_engine, start_gateway

EXAMPLES = int(os.environ.get("KVD_FUZZ_EXAMPLES", "15"))
FORBIDDEN = frozenset({grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL})
MAX_MESSAGE = 4 * 1024 * 1024  # gRPC's default receive limit, which the servers keep
# Streams that never end by themselves (event feeds) are read this long.
STREAM_TIMEOUT_S = 1.0
CALL_TIMEOUT_S = 30.0
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=os.environ.get("KVD_FUZZ_RANDOM") != "1",
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large],
)

INTS = st.one_of(
    st.integers(-3, 300),
    st.sampled_from([0, 1, -1, 2**31 - 1, -(2**31), 2**63 - 1, -(2**63), 49151, 49152, 10**9]),
)
FLOATS = st.one_of(
    st.floats(-10, 10, allow_nan=False), st.sampled_from([math.nan, math.inf, -math.inf, 0.0, 1e30, -0.0, 1e-45])
)
TEXT = st.one_of(st.text(max_size=40), st.sampled_from(["", "a", "support-bot", "../x", "\x00", "é" * 50]))
BYTES = st.one_of(st.binary(max_size=40), st.just(b"\xff" * 300))

_T = FieldDescriptor


def _scalar(field: FieldDescriptor) -> st.SearchStrategy:
    t = field.type
    if t in (_T.TYPE_INT32, _T.TYPE_SINT32, _T.TYPE_SFIXED32):
        return INTS.map(lambda v: max(-(2**31), min(2**31 - 1, v)))
    if t in (_T.TYPE_INT64, _T.TYPE_SINT64, _T.TYPE_SFIXED64):
        return INTS
    if t in (_T.TYPE_UINT32, _T.TYPE_FIXED32):
        return INTS.map(lambda v: abs(v) % 2**32)
    if t in (_T.TYPE_UINT64, _T.TYPE_FIXED64):
        return INTS.map(lambda v: abs(v) % 2**64)
    if t in (_T.TYPE_FLOAT, _T.TYPE_DOUBLE):
        return FLOATS
    if t == _T.TYPE_BOOL:
        return st.booleans()
    if t == _T.TYPE_STRING:
        return TEXT
    if t == _T.TYPE_BYTES:
        return BYTES
    if t == _T.TYPE_ENUM:
        known = [v.number for v in field.enum_type.values]
        return st.one_of(st.sampled_from(known), st.integers(-5, 1000))  # unknown values too
    raise AssertionError(f"unhandled field type {t}")


@st.composite
def message(draw, cls, depth: int = 0):
    """A random message of ``cls``: each field set or not, any value its type allows."""
    msg = cls()
    for field in cls.DESCRIPTOR.fields:
        if not draw(st.booleans()):
            continue
        repeated = field.is_repeated
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            key, value = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
            getattr(msg, field.name).update(draw(st.dictionaries(_scalar(key), _scalar(value), max_size=3)))
        elif field.type == _T.TYPE_MESSAGE:
            if depth > 3 or field.message_type.full_name.startswith("google.protobuf"):
                continue
            sub = message(field.message_type._concrete_class, depth + 1)
            if repeated:
                getattr(msg, field.name).extend(draw(st.lists(sub, max_size=3)))
            else:
                getattr(msg, field.name).CopyFrom(draw(sub))
        elif repeated:
            getattr(msg, field.name).extend(draw(st.lists(_scalar(field), max_size=draw(st.sampled_from([3, 40])))))
        else:
            setattr(msg, field.name, draw(_scalar(field)))
    return msg


def call(channel: grpc.Channel, service, method: str, request) -> grpc.StatusCode:
    """Calls ``method`` however it streams; the status it ends with."""
    desc = service.methods_by_name[method]
    path = f"/{service.full_name}/{method}"
    response = desc.output_type._concrete_class.FromString
    serializer = type(request).SerializeToString
    try:
        if desc.server_streaming:
            method_call = channel.unary_stream(path, request_serializer=serializer, response_deserializer=response)
            stream = method_call(request, timeout=STREAM_TIMEOUT_S * 5)
            for n, _ in enumerate(stream):
                if n >= 20:
                    stream.cancel()
                    break
        else:
            method_call = channel.unary_unary(path, request_serializer=serializer, response_deserializer=response)
            method_call(request, timeout=CALL_TIMEOUT_S)
    except grpc.RpcError as err:
        return err.code()
    return grpc.StatusCode.OK


class Tally:
    def __init__(self) -> None:
        self.codes: Counter = Counter()

    def check(self, what: str, code: grpc.StatusCode) -> None:
        self.codes[code.name] += 1
        assert code not in FORBIDDEN, f"{what} answered {code.name}"

    def report(self, name: str) -> None:
        print(f"\n{name}: {sum(self.codes.values())} cases: {dict(self.codes)}")


# ---------------------------------------------------------------- stacks


@pytest.fixture(scope="module")
def stack(model_dir):
    """A daemon, a float32 engine and a single-user gateway with an embedded Redis."""
    folder = tempfile.mkdtemp(prefix="kvd-fuzz-", dir="/tmp")
    daemon = start_daemon(["--block-size", "16", "--num-blocks", "512", "--lease-s", "2"], folder)
    engine = start_engine(daemon, ["--model", str(model_dir)], folder)
    gateway = start_gateway(engine.address, ["--data-dir", f"{folder}/gw"], folder)
    yield daemon, engine, gateway
    for process in (gateway, engine, daemon):
        process.stop()
        assert process.process.returncode in (0, -15), f"{process.address} exited with {process.process.returncode}"
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def small_daemon():
    """A daemon of its own (tiny layout), for its session-level RPCs."""
    folder = tempfile.mkdtemp(prefix="kvd-fuzzd-", dir="/tmp")
    daemon = start_daemon(
        [*SMALL_LAYOUT, "--num-blocks", "32", "--lease-s", "2", "--max-pinned-fraction", "0.5"], folder
    )
    yield daemon
    daemon.stop()
    assert daemon.process.returncode in (0, -15)
    shutil.rmtree(folder, ignore_errors=True)


def _alive(*processes) -> None:
    for process in processes:
        assert process.process.poll() is None, f"{process.address} died:\n{process.log()[-3000:]}"


def _no_request_holds_blocks(daemon) -> None:
    from tests.conftest import wait_for

    def settled() -> bool:
        stats = DaemonClient.connect(daemon.address).stats()
        return stats.num_requests == 0 and stats.num_used_blocks == stats.num_pinned_blocks

    assert wait_for(settled, 60), DaemonClient.connect(daemon.address).stats()


def _fuzz_service(channel, service, request_classes: dict, tally: Tally, skip=()) -> None:
    for method in service.methods:
        if method.name in skip:
            continue
        cls = request_classes[method.name]
        _fuzz_method(channel, service, method.name, cls, tally)
        # One oversized message per method: over the server's receive limit.
        big = cls()
        text_fields = [f for f in cls.DESCRIPTOR.fields if f.type in (_T.TYPE_STRING, _T.TYPE_BYTES)
                       and not f.is_repeated]  # fmt: skip
        if text_fields:
            f = text_fields[0]
            setattr(big, f.name, ("x" if f.type == _T.TYPE_STRING else b"x") * (MAX_MESSAGE + 10))
            code = call(channel, service, method.name, big)
            tally.check(f"{service.name}.{method.name} oversized", code)
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, (method.name, code)


def _fuzz_method(channel, service, method_name: str, cls, tally: Tally) -> None:
    @FUZZ
    @given(request=message(cls))
    def one(request):
        tally.check(f"{service.name}.{method_name}", call(channel, service, method_name, request))

    one()


def _request_classes(module, service) -> dict:
    return {m.name: m.input_type._concrete_class for m in service.methods}


def test_gateway_rpcs(stack):
    daemon, engine, gateway = stack
    service = gpb.DESCRIPTOR.services_by_name["Gateway"]
    tally = Tally()
    with grpc.insecure_channel(gateway.address) as channel:
        _fuzz_service(channel, service, _request_classes(gpb, service), tally)
    tally.report("gateway")
    _alive(daemon, engine, gateway)
    _no_request_holds_blocks(daemon)


def test_engine_rpcs(stack):
    daemon, engine, gateway = stack
    service = epb.DESCRIPTOR.services_by_name["Engine"]
    tally = Tally()
    with grpc.insecure_channel(engine.address) as channel:
        _fuzz_service(channel, service, _request_classes(epb, service), tally)
    tally.report("engine")
    _alive(daemon, engine, gateway)
    _no_request_holds_blocks(daemon)


def test_daemon_rpcs(small_daemon):
    service = dpb.DESCRIPTOR.services_by_name["KVDaemon"]
    tally = Tally()
    with DaemonClient.connect(small_daemon.address) as owner, grpc.insecure_channel(small_daemon.address) as channel:
        # A live session with a running request: fuzzed Steps name it, its
        # request and its blocks, from another caller.
        session = owner.attach("fuzz-owner", map_memory=False)
        reply = owner.stub.Step(dpb.StepRequest(
            session_id=session.session_id, settings=dpb.SessionSettings(max_num_seqs=4, token_budget=64),
            new_requests=[dpb.NewRequest(request_id="owned", prompt_token_ids=list(range(20)))],
        ))  # fmt: skip
        assert reply.scheduled.request_ids == ["owned"]
        classes = _request_classes(dpb, service)

        @FUZZ
        @given(request=message(dpb.StepRequest), aim=st.sampled_from(["own", "random"]),
               names=st.lists(st.sampled_from(["owned", "other", ""]), max_size=3))  # fmt: skip
        def step(request, aim, names):
            if aim == "own":
                request.session_id = session.session_id
            request.finished.extend(names)
            tally.check("KVDaemon.Step", call(channel, service, "Step", request))

        step()
        # Reset and Detach would end the owner's session: fuzzed after everything else.
        _fuzz_service(channel, service, classes, tally, skip={"Step", "Reset", "Detach"})
        _fuzz_service(channel, service, classes, tally, skip=set(classes) - {"Reset", "Detach"})
        with contextlib.suppress(grpc.RpcError):  # a fuzzed Reset may have ended it already
            session.detach()
    tally.report("daemon")
    _alive(small_daemon)
    _no_request_holds_blocks(small_daemon)
