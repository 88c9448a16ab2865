"""The public API called the way outside clients call it: with no deadline
(the default of most gRPC clients and of grpcurl), and from another language
(Node's @grpc/grpc-js on the .proto files, running the README's examples).

One daemon, one float32 engine and one single-user gateway for the module,
with the real Redis at 127.0.0.1:6379 (keys under a prefix of its own).
"""

from __future__ import annotations

import json
import secrets
import shutil
import subprocess
import tempfile
from pathlib import Path

import grpc
import pytest
import redis

from gateway.client import GatewayClient
from kvd_api.engine.v1 import engine_pb2 as epb
from kvd_api.gateway.v1 import gateway_pb2 as pb
from kvd_api.gateway.v1 import gateway_pb2_grpc as pb_grpc
from tests.conftest import start_daemon, start_engine, start_gateway

ROOT = Path(__file__).resolve().parents[2]
NODE_CLIENT = ROOT / "tests" / "clients" / "node"
README_PROMPT = " Customer: what do you sell? Assistant:"


@pytest.fixture(scope="module")
def stack(model_dir):
    folder = tempfile.mkdtemp(prefix="kvd-pub-", dir="/tmp")
    daemon = start_daemon(["--block-size", "16", "--num-blocks", "512", "--lease-s", "2"], folder)
    engine = start_engine(daemon, ["--model", str(model_dir)], folder)
    prefix = f"kvd-test-{secrets.token_hex(4)}:"
    gateway = start_gateway(
        engine.address, ["--redis-url", "redis://127.0.0.1:6379/0", "--redis-prefix", prefix], folder
    )
    yield gateway
    gateway.stop()
    engine.stop()
    daemon.stop()
    server = redis.Redis(host="127.0.0.1", port=6379)
    for key in server.scan_iter(f"{prefix}*"):
        server.delete(key)
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def stub(stack):
    with grpc.insecure_channel(stack.address) as channel:
        yield pb_grpc.GatewayStub(channel)


def test_calls_without_a_deadline_are_served(stub):
    # No `timeout=` anywhere: the gateway must not turn "no deadline" into an
    # expired one when it calls the engine.
    name = f"nodeadline-{secrets.token_hex(3)}"
    template = stub.CreateTemplate(pb.CreateTemplateRequest(name=name, content="You are a terse assistant. " * 4))
    assert template.token_count > 16
    sampling = epb.SamplingParams(max_new_tokens=6, ignore_eos=True)
    request = pb.GenerateRequest(template=name, text=" Hi!", sampling=sampling)
    streamed = [t for message in stub.Generate(request) for t in message.token_ids]
    whole = stub.Complete(request)
    assert len(streamed) == 6
    assert list(whole.token_ids) == streamed
    assert whole.usage.cached_prompt_tokens >= 16


@pytest.fixture(scope="module")
def node_client() -> Path:
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("Node.js and npm are not installed on this machine")
    if not (NODE_CLIENT / "node_modules" / "@grpc" / "grpc-js").is_dir():
        subprocess.run(["npm", "ci", "--no-audit", "--no-fund"], cwd=NODE_CLIENT, check=True, timeout=300)
    return NODE_CLIENT / "readme_examples.js"


def test_readme_examples_from_node(stack, node_client):
    name = f"support-bot-{secrets.token_hex(3)}"
    run = subprocess.run(
        ["node", str(node_client), stack.address, str(ROOT / "protos"), name],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    replies = {r["what"]: r for r in map(json.loads, run.stdout.splitlines())}
    assert replies["CreateTemplate"]["token_count"] >= 16
    generated, completed = replies["Generate"], replies["Complete"]
    assert len(generated["token_ids"]) == 8
    assert generated["token_ids"] == completed["token_ids"]
    assert generated["usage"]["cached_prompt_tokens"] >= 16  # the README's promise: the template's warm blocks
    assert replies["Info"]["templates"] >= 1
    # The same request from Python (with a deadline) gets the same tokens.
    with GatewayClient(stack.address, timeout_s=120) as client:
        reply = client.complete(README_PROMPT, template=name, max_new_tokens=8, ignore_eos=True)
    assert list(reply.token_ids) == generated["token_ids"]
