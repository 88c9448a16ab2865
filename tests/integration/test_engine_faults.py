"""Faults: cancelled and expired requests, a killed client, a lost daemon, a killed engine."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading

import grpc
from grpc_health.v1 import health_pb2

from kvd.common.client import DaemonClient
from kvd_api.engine.v1 import engine_pb2 as pb
from tests.conftest import blocks_held, health_status, start_daemon, wait_for
from tests.integration.engine_client import generate, request, stub

LONG = list(range(1000, 1300))  # 300 tokens: ~19 blocks while it runs


def test_cancelled_expired_and_abandoned_requests_leave_no_blocks(shared_stack):
    engine = stub(shared_stack.address)
    daemon = shared_stack.daemon
    # Cancelled mid-stream.
    stream = engine.Generate(request(LONG, 400))
    next(stream)
    assert blocks_held(daemon) > 0
    stream.cancel()
    assert wait_for(lambda: blocks_held(daemon) == 0), "a cancelled stream kept its blocks"
    # A deadline that expires mid-generation.
    try:
        generate(engine, request(LONG, 400), timeout_s=1.5)
        raise AssertionError("the deadline did not expire")
    except grpc.RpcError as err:
        assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert wait_for(lambda: blocks_held(daemon) == 0), "an expired request kept its blocks"
    # A client process killed mid-stream.
    client = textwrap.dedent(
        f"""
        import grpc, sys
        from kvd_api.engine.v1 import engine_pb2 as pb, engine_pb2_grpc as pbg
        engine = pbg.EngineStub(grpc.insecure_channel("{shared_stack.address}"))
        req = pb.GenerateRequest(token_ids=pb.TokenIds(ids={LONG}),
                                 sampling=pb.SamplingParams(max_new_tokens=400, ignore_eos=True))
        for message in engine.Generate(req):
            print("streaming", flush=True)
        """
    )
    process = subprocess.Popen([sys.executable, "-c", client], stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "streaming"
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert wait_for(lambda: blocks_held(daemon) == 0), "a killed client's request kept its blocks"
    # The engine still serves.
    tokens, _, _ = generate(engine, request([1, 2, 3], 3))
    assert len(tokens) == 3


def test_a_lost_daemon_fails_requests_then_the_engine_reattaches(stack_factory, workdir):
    stack = stack_factory()
    engine = stub(stack.address)
    errors: list[grpc.RpcError] = []

    def long_request():
        try:
            generate(engine, request(LONG, 2000))
        except grpc.RpcError as err:
            errors.append(err)

    worker = threading.Thread(target=long_request)
    worker.start()
    assert wait_for(lambda: blocks_held(stack.daemon) > 0)
    stack.daemon.stop(signal.SIGKILL)
    worker.join(timeout=60)
    assert errors and errors[0].code() == grpc.StatusCode.UNAVAILABLE, errors
    assert "daemon" in errors[0].details()
    assert wait_for(lambda: health_status(stack.address) == health_pb2.HealthCheckResponse.NOT_SERVING)
    try:
        generate(engine, request([1, 2, 3], 2))
        raise AssertionError("served without a daemon")
    except grpc.RpcError as err:
        assert err.code() == grpc.StatusCode.UNAVAILABLE

    # The daemon comes back on the same socket: the engine attaches again.
    folder = stack.daemon.socket_path.rsplit("/", 1)[0]
    revived = start_daemon(["--block-size", "16", "--lease-s", "2"], folder)
    try:
        assert wait_for(lambda: health_status(stack.address) == health_pb2.HealthCheckResponse.SERVING, 30)
        tokens, _, final = generate(engine, request([1, 2, 3], 4))
        assert len(tokens) == 4 and final.finish_reason == pb.FINISH_REASON_LENGTH
    finally:
        revived.stop()


def test_a_killed_engines_blocks_are_released(stack_factory):
    stack = stack_factory()
    stream = stub(stack.address).Generate(request(LONG, 2000))
    next(stream)
    assert blocks_held(stack.daemon) > 0
    stack.stop(signal.SIGKILL)
    assert wait_for(lambda: blocks_held(stack.daemon) == 0, 15), "the dead engine's blocks stayed held"
    assert DaemonClient.connect(stack.daemon.address).stats().num_sessions == 0
