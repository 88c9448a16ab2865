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
from tests.conftest import gateway_on_local_redis, start_daemon, start_engine, start_gateway, wait_for

ROOT = Path(__file__).resolve().parents[2]
NODE_CLIENT = ROOT / "tests" / "clients" / "node"
README_PROMPT = " Customer: what do you sell? Assistant:"


@pytest.fixture(scope="module")
def stack(model_dir):
    folder = tempfile.mkdtemp(prefix="kvd-pub-", dir="/tmp")
    daemon = start_daemon(["--block-size", "16", "--num-blocks", "512", "--lease-s", "2"], folder)
    engine = start_engine(daemon, ["--model", str(model_dir)], folder)
    try:
        with gateway_on_local_redis(engine.address, folder, 1) as gateway:
            yield gateway
    finally:
        engine.stop()
        daemon.stop()
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


def _generate(prompt: str = "Hi", **kwargs) -> pb.GenerateRequest:
    request = pb.GenerateRequest(text=prompt, sampling=epb.SamplingParams(max_new_tokens=2))
    for name, value in kwargs.items():
        target, _, field = name.rpartition("__")
        message = getattr(request, target) if target else request
        if isinstance(value, list):
            getattr(message, field).extend(value)
        else:
            setattr(message, field, value)
    return request


def _token_prompt(ids: list[int]) -> pb.GenerateRequest:
    request = pb.GenerateRequest(sampling=epb.SamplingParams(max_new_tokens=2))
    request.token_ids.ids.extend(ids)
    return request


def _chat_without_role() -> pb.GenerateRequest:
    request = pb.GenerateRequest()
    request.chat.messages.add(content="hello")
    return request


# (method, request, a part of the message that names the field)
BAD_REQUESTS = [
    ("Complete", _generate(sampling__stop_token_ids=[-1]), "sampling.stop_token_ids"),
    ("Complete", _generate(sampling__stop_token_ids=[10**12]), "sampling.stop_token_ids"),
    ("Complete", _generate(sampling__temperature=float("nan")), "sampling.temperature"),
    ("Complete", _generate(sampling__top_p=2.0), "sampling.top_p"),
    ("Complete", _generate(sampling__top_k=-3), "sampling.top_k"),
    ("Complete", _generate(sampling__max_new_tokens=-1), "sampling.max_new_tokens"),
    ("Complete", _generate(sampling__prompt_top_logprobs=21), "sampling.prompt_top_logprobs"),
    ("Complete", _generate(sampling__max_new_tokens=10**9), "max_new_tokens"),
    ("Complete", _generate(sampling__top_logprobs=99), "sampling.top_logprobs"),
    ("Complete", _generate(sampling__stop=[""]), "sampling.stop"),
    ("Complete", _generate(template="Not A Name"), "template"),
    ("Complete", _generate(cache_salt=b"s" * 257), "cache_salt"),
    ("Complete", _token_prompt([1, -5]), "token_ids"),
    ("Complete", _token_prompt([10**9]), "token_ids"),
    ("Complete", _chat_without_role(), "chat.messages[0].role"),
    ("Complete", pb.GenerateRequest(), "prompt"),
    ("Generate", _generate(sampling__stop_token_ids=[-1]), "sampling.stop_token_ids"),
    ("CreateTemplate", pb.CreateTemplateRequest(name="ok-name", content=""), "content"),
    ("CreateTemplate", pb.CreateTemplateRequest(name="-bad", content="x"), "name"),
    ("CreateTemplate", pb.CreateTemplateRequest(name="ok-name", content="x", ttl_seconds=-1), "ttl_seconds"),
    ("CreateTemplate", pb.CreateTemplateRequest(name="ok-name", content="x", ttl_seconds=2**62), "ttl_seconds"),
    ("CreateTemplate", pb.CreateTemplateRequest(name="ok-name", content="x", description="d" * 2000), "description"),
    ("GetTemplate", pb.GetTemplateRequest(name=""), "name"),
    ("DeleteTemplate", pb.DeleteTemplateRequest(name="a/b"), "name"),
    ("UpdateTemplate", pb.UpdateTemplateRequest(name="ok-name", ttl_seconds=-5), "ttl_seconds"),
    ("ListTemplates", pb.ListTemplatesRequest(page_size=-1), "page_size"),
    ("ListTemplates", pb.ListTemplatesRequest(page_token="zzz"), "page_token"),
    ("ListTemplates", pb.ListTemplatesRequest(page_token="abc.0123456789abcdef0123456789abcdef"), "page_token"),
]


@pytest.mark.parametrize(("method", "request_", "field"), BAD_REQUESTS, ids=lambda v: v if isinstance(v, str) else "")
def test_bad_fields_are_refused_by_name(stub, method, request_, field):
    call = getattr(stub, method)
    with pytest.raises(grpc.RpcError) as info:
        reply = call(request_, timeout=60)
        if method == "Generate":
            list(reply)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert field in info.value.details()


def test_page_tokens_are_the_listings_own(stub):
    names = [f"page-{i}-{secrets.token_hex(2)}" for i in range(3)]
    for name in names:
        stub.CreateTemplate(pb.CreateTemplateRequest(name=name, content=f"Template {name}."), timeout=120)
    seen, token = [], ""
    while True:
        page = stub.ListTemplates(pb.ListTemplatesRequest(page_size=1, page_token=token), timeout=30)
        seen += [t.name for t in page.templates]
        token = page.next_page_token
        if not token:
            break
        # A token names a position: editing it makes it one no listing produced.
        forged = token.rpartition(".")[0] + "." + "0" * 32
        with pytest.raises(grpc.RpcError) as info:
            stub.ListTemplates(pb.ListTemplatesRequest(page_token=forged), timeout=30)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert set(names) <= set(seen)
    assert seen == sorted(seen)


# --------------------------------------------------------------- limits

LIMIT_KEYS = {"alpha-key": "alpha", "beta-key": "beta"}


@pytest.fixture(scope="module")
def limited(stack, model_dir):
    """A second gateway on the same engine, two tenants, small per-tenant limits."""
    folder = tempfile.mkdtemp(prefix="kvd-lim-", dir="/tmp")
    keys = [{"key": k, "tenant": t, "scopes": ["generate", "templates:write"]} for k, t in LIMIT_KEYS.items()]
    Path(folder, "keys.json").write_text(json.dumps({"keys": keys}))
    prefix = f"kvd-test-{secrets.token_hex(4)}:"
    args = ["--redis-url", "redis://127.0.0.1:6379/0", "--redis-prefix", prefix, "--api-keys", f"{folder}/keys.json",
            "--max-concurrent-requests", "2", "--max-templates", "2", "--max-pinned-blocks", "3"]  # fmt: skip
    gateway = start_gateway(_engine_of(stack), args, folder)
    yield gateway
    gateway.stop()
    server = redis.Redis(host="127.0.0.1", port=6379)
    for key in server.scan_iter(f"{prefix}*"):
        server.delete(key)
    shutil.rmtree(folder, ignore_errors=True)


def _engine_of(gateway) -> str:
    return gateway.process.args[gateway.process.args.index("--engines") + 1]


def _client(gateway, tenant_key: str) -> GatewayClient:
    return GatewayClient(gateway.address, api_key=tenant_key, timeout_s=120)


def _exhausted(call) -> str:
    with pytest.raises(grpc.RpcError) as info:
        call()
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value.details()
    return info.value.details()


def test_concurrent_requests_per_tenant(limited):
    with _client(limited, "alpha-key") as alpha, _client(limited, "beta-key") as beta:
        streams = [alpha.generate("Count: one, two,", max_new_tokens=400, ignore_eos=True) for _ in range(2)]
        try:
            for stream in streams:
                next(stream)  # both run
            assert "max_concurrent_requests" in _exhausted(lambda: alpha.complete("Hi", max_new_tokens=1))
            assert len(beta.complete("Hi", max_new_tokens=1).token_ids) == 1  # another tenant is not held up
        finally:
            for stream in streams:
                stream.cancel()
        # Cancelled requests give their slots back.
        assert wait_for(lambda: _completes(alpha), timeout_s=20)


def _completes(client: GatewayClient) -> bool:
    try:
        return len(client.complete("Hi", max_new_tokens=1).token_ids) == 1
    except grpc.RpcError as err:
        if err.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
            raise
        return False


def test_templates_and_pinned_blocks_per_tenant(limited):
    two_blocks = "You answer briefly and politely, in plain English, about anvils. " * 2 + "Always be kind."  # 34
    with _client(limited, "alpha-key") as alpha, _client(limited, "beta-key") as beta:
        first = alpha.create_template("first", two_blocks)
        assert 32 <= first.token_count < 48
        # 2 pinned + 2 more > 3: the pinned-block limit, named.
        assert "max_pinned_blocks" in _exhausted(lambda: alpha.create_template("second", two_blocks))
        alpha.create_template("small", "Be brief.")  # no full block: pins nothing
        assert "max_templates" in _exhausted(lambda: alpha.create_template("third", "Be kind."))
        # The other tenant's own limits are untouched.
        beta.create_template("first", two_blocks)
        alpha.delete_template("small")
        alpha.create_template("third", "Be kind.")
        for name in ("first", "third"):
            alpha.delete_template(name)
        beta.delete_template("first")
