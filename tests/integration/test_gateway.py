"""The gateway in front of a real daemon and a float64 engine, with the real
Redis at 127.0.0.1:6379 (its keys under a prefix of this module's own)."""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
import redis
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from benchmarks.harness.processes import free_port_at, spawn, stop_process
from gateway.client import GatewayClient
from inference import model_store
from kvd.common.client import DaemonClient
from kvd.common.field_error import field_of
from tests.conftest import (
    blocks_held,
    free_port,
    health_status,
    start_daemon,
    start_engine,
    start_gateway,
    start_redis,
    wait_for,
)
from tests.integration.engine_client import reference_greedy, stub
from tests.integration.engine_client import request as engine_request
from tests.integration.gateway_client import completion, document, status_of

BLOCK = 16
KEYS = {
    "acme-key": ("acme", ["generate", "templates:write"]),
    "globex-key": ("globex", ["generate", "templates:write"]),
    "reader-key": ("acme", ["generate"]),
}
SUPPORT = (
    "You are the support assistant of ACME Corp. You answer questions about ACME's products politely and "
    "briefly. ACME sells anvils, rockets, giant magnets and portable holes to customers worldwide, and every "
    "order ships within two days."
)


@pytest.fixture(scope="module")
def folder():
    path = tempfile.mkdtemp(prefix="kvd-gw-", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def replica(model_dir, folder):
    """A daemon whose pin cap is 51 blocks (816 tokens) and a float64 engine."""
    daemon = start_daemon(
        ["--block-size", str(BLOCK), "--num-blocks", "1024", "--lease-s", "2", "--max-pinned-fraction", "0.05"],
        folder,
    )
    engine = start_engine(daemon, ["--model", str(model_dir), "--dtype", "float64"], folder)
    yield engine
    engine.stop()
    daemon.stop()


@pytest.fixture(scope="module")
def gateway(replica, folder):
    keys_file = f"{folder}/keys.json"
    entries = [{"key": key, "tenant": tenant, "scopes": scopes} for key, (tenant, scopes) in KEYS.items()]
    entries[1] = {**entries[1], "key_sha256": hashlib.sha256(b"globex-key").hexdigest()}  # the stored form
    del entries[1]["key"]
    with open(keys_file, "w") as f:
        json.dump({"keys": entries}, f)
    prefix = f"kvd-test-{secrets.token_hex(4)}:"
    args = ["--redis-url", "redis://127.0.0.1:6379/0", "--redis-prefix", prefix, "--api-keys", keys_file]
    gw = start_gateway(replica.address, args, folder)
    yield gw
    gw.stop()
    server = redis.Redis(host="127.0.0.1", port=6379)
    for key in server.scan_iter(f"{prefix}*"):
        server.delete(key)


@pytest.fixture
def acme(gateway):
    with GatewayClient(gateway.address, api_key="acme-key", timeout_s=120) as client:
        yield client


@pytest.fixture
def globex(gateway):
    with GatewayClient(gateway.address, api_key="globex-key", timeout_s=120) as client:
        yield client


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def daemon_stats(replica):
    with DaemonClient.connect(replica.daemon.address) as daemon:
        return daemon.stats()


def aligned(n: int) -> int:
    return n // BLOCK * BLOCK


# ------------------------------------------------------------ lifecycle


def test_template_lifecycle(acme, replica, tokenizer):
    pins = daemon_stats(replica).num_pins
    created = acme.create_template("support-bot", SUPPORT, description="first")
    tokens = len(encode(tokenizer, SUPPORT))
    assert (created.name, created.content, created.description) == ("support-bot", SUPPORT, "first")
    assert created.token_count == tokens and created.cached_token_count == aligned(tokens)
    assert not created.HasField("expire_time")
    assert daemon_stats(replica).num_pins == pins + 1
    assert acme.get_template("support-bot").content == SUPPORT
    assert "support-bot" in [t.name for t in acme.list_templates()]
    assert acme.info().templates >= 1

    before = int(time.time())
    updated = acme.update_template("support-bot", ttl_seconds=100, description="second")
    after = int(time.time()) + 1
    assert updated.description == "second" and updated.HasField("expire_time")
    assert before + 99 <= updated.expire_time.seconds <= after + 100  # 100 s from the update, however slow
    assert not acme.update_template("support-bot", ttl_seconds=0).HasField("expire_time")

    acme.delete_template("support-bot")
    assert status_of(lambda: acme.get_template("support-bot"))[0] == grpc.StatusCode.NOT_FOUND
    assert status_of(lambda: acme.delete_template("support-bot"))[0] == grpc.StatusCode.NOT_FOUND
    assert daemon_stats(replica).num_pins == pins


def test_listing_pages_in_name_order(acme):
    names = [f"page-{i}" for i in range(5)]
    for name in reversed(names):
        acme.create_template(name, f"Template number {name}.")
    try:
        listed = [t.name for t in acme.list_templates(page_size=2) if t.name.startswith("page-")]
        assert listed == names
    finally:
        for name in names:
            acme.delete_template(name)


def test_bad_template_calls_get_clear_statuses(acme, replica, tokenizer):
    acme.create_template("taken", "Some content.")
    try:
        code, message = status_of(lambda: acme.create_template("taken", "Other content."))
        assert code == grpc.StatusCode.ALREADY_EXISTS and "taken" in message
    finally:
        acme.delete_template("taken")
    cases = {
        "bad name": (lambda: acme.create_template("Bad Name", "x"), "not allowed"),
        "empty content": (lambda: acme.create_template("empty", ""), "content"),
        "negative ttl": (lambda: acme.create_template("neg", "x", ttl_seconds=-1), "ttl"),
        "beyond the context": (lambda: acme.create_template("huge", document(tokenizer, 8300)), "context"),
    }
    for label, (call, words) in cases.items():
        code, message = status_of(call)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, label
        assert words in message, (label, message)
    with pytest.raises(grpc.RpcError) as refused:
        acme.create_template("neg", "x", ttl_seconds=-1)
    assert field_of(refused.value) == "ttl_seconds"  # named beside the status, as an engine's refusals are
    code, message = status_of(lambda: acme.complete("hi", template="no-such-template"))
    assert code == grpc.StatusCode.NOT_FOUND and "no-such-template" in message


def test_a_template_over_the_pin_cap_is_refused_and_leaves_nothing(acme, replica, tokenizer):
    before = daemon_stats(replica)
    code, message = status_of(lambda: acme.create_template("too-big", document(tokenizer, 900)))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "cap" in message
    assert status_of(lambda: acme.get_template("too-big"))[0] == grpc.StatusCode.NOT_FOUND
    after = daemon_stats(replica)
    assert (after.num_pins, after.num_pinned_blocks) == (before.num_pins, before.num_pinned_blocks)


# ----------------------------------------------------------- generation


def test_a_templated_request_is_the_template_tokens_then_the_prompt(acme, replica, tokenizer, model_dir):
    acme.create_template("support-bot-2", SUPPORT)
    try:
        question = " Customer: how fast do you ship? Assistant:"
        tokens, usage = completion(acme, question, template="support-bot-2", max_new_tokens=12)
        template_ids, prompt_ids = encode(tokenizer, SUPPORT), encode(tokenizer, question)
        # The first request after creation is served from the warmed blocks.
        assert usage.template_tokens == len(template_ids)
        assert usage.prompt_tokens == len(template_ids) + len(prompt_ids)
        assert usage.cached_prompt_tokens >= aligned(len(template_ids))
        assert usage.completion_tokens == 12

        plain, _ = completion(acme, template_ids + prompt_ids, max_new_tokens=12)
        assert tokens == plain
        reference = model_store.load_model(model_dir, torch.float64, "cpu")
        assert tokens == reference_greedy(reference, template_ids + prompt_ids, 12)

        streamed = [t for chunk in acme.generate(question, template="support-bot-2", max_new_tokens=12,
                                                   ignore_eos=True) for t in chunk.token_ids]  # fmt: skip
        assert streamed == tokens
    finally:
        acme.delete_template("support-bot-2")


CHAT_TEMPLATE = [
    ("system", SUPPORT),
    ("user", "Do you ship abroad?"),
    ("assistant", "Yes, to every country, within two days."),
]


def chat_ids(tokenizer, messages, add_generation_prompt: bool) -> list[int]:
    dicts = [{"role": r, "content": c} for r, c in messages]
    return list(tokenizer.apply_chat_template(dicts, add_generation_prompt=add_generation_prompt)["input_ids"])


def test_a_chat_template_is_rendered_with_the_request_messages(acme, replica, tokenizer):
    created = acme.create_template("support-chat", messages=CHAT_TEMPLATE)
    try:
        template_ids = chat_ids(tokenizer, CHAT_TEMPLATE, False)
        assert (created.token_count, created.cached_token_count) == (len(template_ids), aligned(len(template_ids)))
        assert [(m.role, m.content) for m in acme.get_template("support-chat").messages] == CHAT_TEMPLATE

        question = [("user", "What do you sell?")]
        expected = chat_ids(tokenizer, CHAT_TEMPLATE + question, True)
        tokens, usage = completion(acme, chat=question, template="support-chat", max_new_tokens=8)
        assert (usage.prompt_tokens, usage.template_tokens) == (len(expected), len(template_ids))
        assert usage.cached_prompt_tokens >= aligned(len(template_ids))
        # Float64: the same prompt gives the same greedy tokens; the rendering
        # itself is compared token for token in tests/unit/test_gateway_prompts.py.
        assert tokens == completion(acme, expected, max_new_tokens=8)[0]

        code, message = status_of(lambda: acme.complete(" Hi", template="support-chat"))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "holds chat messages" in message
    finally:
        acme.delete_template("support-chat")
    acme.create_template("support-text", SUPPORT)
    try:
        code, message = status_of(lambda: acme.complete(chat=[("user", "Hi")], template="support-text"))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "holds text" in message
    finally:
        acme.delete_template("support-text")


def test_a_gateway_client_gets_what_an_engine_client_gets(acme, replica, tokenizer):
    ids = encode(tokenizer, "The capital of France is")
    sampling = {"max_new_tokens": 4, "logprobs": True, "top_logprobs": 3}
    through_gateway = acme.complete(ids, ignore_eos=True, **sampling)
    direct = list(stub(replica.address).Generate(engine_request(ids, **sampling), timeout=120))
    assert list(through_gateway.token_ids) == [t for m in direct for t in m.token_ids]
    assert list(through_gateway.top_logprobs) == [t for m in direct for t in m.top_logprobs]
    assert [len(t.token_ids) for t in through_gateway.top_logprobs] == [3] * 4
    assert list(through_gateway.logprobs) == [lp for m in direct for lp in m.logprobs]
    # Usage: every engine field, host-tier hits included (0: this daemon has no host tier).
    engine_usage = direct[-1].usage
    assert through_gateway.usage.prompt_tokens == engine_usage.prompt_tokens
    assert through_gateway.usage.host_cached_prompt_tokens == engine_usage.host_cached_prompt_tokens == 0


def test_tenants_never_share_templates_or_cached_blocks(acme, globex, tokenizer):
    acme.create_template("bot", SUPPORT)
    globex.create_template("bot", "You are the assistant of Globex. Be terse.")
    try:
        assert acme.get_template("bot").content == SUPPORT
        assert globex.get_template("bot").content.startswith("You are the assistant of Globex")
        same_tokens = encode(tokenizer, SUPPORT) + encode(tokenizer, " Hello")
        _, globex_usage = completion(globex, same_tokens, max_new_tokens=1)
        assert globex_usage.cached_prompt_tokens == 0  # acme's warm blocks are not globex's
        _, acme_usage = completion(acme, same_tokens, max_new_tokens=1)
        assert acme_usage.cached_prompt_tokens >= aligned(len(encode(tokenizer, SUPPORT)))
    finally:
        acme.delete_template("bot")
        globex.delete_template("bot")


def test_keys_and_scopes(gateway):
    with GatewayClient(gateway.address) as anonymous:
        code, message = status_of(anonymous.info)
        assert code == grpc.StatusCode.UNAUTHENTICATED and "API key" in message
    with GatewayClient(gateway.address, api_key="wrong") as stranger:
        assert status_of(lambda: stranger.complete("hi"))[0] == grpc.StatusCode.UNAUTHENTICATED
    with GatewayClient(gateway.address, api_key="reader-key") as reader:
        tokens, _ = completion(reader, "The capital of France is", max_new_tokens=2)
        assert len(tokens) == 2
        code, message = status_of(lambda: reader.create_template("mine", "x"))
        assert code == grpc.StatusCode.PERMISSION_DENIED and "templates:write" in message
        assert status_of(lambda: reader.delete_template("mine"))[0] == grpc.StatusCode.PERMISSION_DENIED
        assert reader.info().block_size == BLOCK and reader.info().model_type == "llama"


def test_keys_kept_in_redis(replica, folder):
    prefix = f"kvd-test-{secrets.token_hex(4)}:"
    redis_args = ["--redis-url", "redis://127.0.0.1:6379/0", "--redis-prefix", prefix]
    add_key = [sys.executable, "-m", "gateway.cli", "add-key", *redis_args, "--tenant", "initech"]
    writer = subprocess.run(add_key, capture_output=True, text=True, check=True).stdout.strip()
    reader = subprocess.run([*add_key, "--scopes", "generate"], capture_output=True, text=True, check=True)
    gw = start_gateway(replica.address, [*redis_args, "--api-keys", "redis"], folder)
    try:
        with GatewayClient(gw.address, api_key=writer) as client:
            client.create_template("initech-bot", "You work at Initech.")
            client.delete_template("initech-bot")
        with GatewayClient(gw.address, api_key=reader.stdout.strip()) as client:
            code = status_of(lambda: client.create_template("initech-bot", "x"))[0]
            assert code == grpc.StatusCode.PERMISSION_DENIED
        with GatewayClient(gw.address, api_key="kvd-not-a-key") as client:
            assert status_of(client.info)[0] == grpc.StatusCode.UNAUTHENTICATED
        # Only the keys' hashes are stored.
        stored = [k.decode() for k in redis.Redis(host="127.0.0.1", port=6379).scan_iter(f"{prefix}apikey:*")]
        assert len(stored) == 2 and all(writer not in k for k in stored)
    finally:
        gw.stop()
        server = redis.Redis(host="127.0.0.1", port=6379)
        for key in server.scan_iter(f"{prefix}*"):
            server.delete(key)


def test_health_and_reflection(gateway):
    with grpc.insecure_channel(gateway.address) as channel:
        for service in ("", "kvd.gateway.v1.Gateway"):
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        answers = reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = {s.name for s in next(answers).list_services_response.service}
    assert {"kvd.gateway.v1.Gateway", "grpc.health.v1.Health"} <= names


def test_an_expired_template_is_gone_and_unpinned(acme, replica):
    assert acme.create_template("short-lived", SUPPORT, ttl_seconds=2).cached_token_count > 0  # pinned
    pinned = daemon_stats(replica).num_pins
    # NOTE: expired first, then unpinned: a pin count compared with one read
    # before the create could also drop when another test's pin goes.
    assert wait_for(lambda: _missing(lambda: acme.get_template("short-lived")), 10), "the template did not expire"
    assert wait_for(lambda: daemon_stats(replica).num_pins <= pinned - 1, 10), "the expired template stayed pinned"
    assert status_of(lambda: acme.complete("x", template="short-lived"))[0] == grpc.StatusCode.NOT_FOUND
    assert "short-lived" not in [t.name for t in acme.list_templates()]


def test_a_cancelled_stream_leaves_no_blocks_held(acme, replica):
    acme.create_template("cancel-me", SUPPORT)
    try:
        stream = acme.generate(" Tell me everything.", template="cancel-me", max_new_tokens=2000, ignore_eos=True)
        next(stream)
        assert blocks_held(replica.daemon) > 0
        stream.cancel()
        assert wait_for(lambda: blocks_held(replica.daemon) == 0, 10), "the cancelled request kept its blocks"
    finally:
        acme.delete_template("cancel-me")


def test_the_cli_manages_templates_and_generates(gateway):
    def cli(*args: str) -> str:
        cmd = [sys.executable, "-m", "gateway.client_cli", "--address", gateway.address, "--api-key", "acme-key"]
        done = subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return done.stdout

    assert '"tokenCount"' in cli("template", "create", "cli-bot", "--content", SUPPORT, "--ttl", "600")
    try:
        assert "cli-bot" in cli("template", "list")
        out = cli("generate", "--template", "cli-bot", "--max-new-tokens", "4", " Hello!")
        assert '"templateTokens"' in out and '"cachedPromptTokens"' in out
        assert '"messages"' in cli("template", "create", "cli-chat", "--message", f"system:{SUPPORT}")
        out = cli("generate", "--template", "cli-chat", "--chat", "--max-new-tokens", "4", "What do you sell?")
        assert '"templateTokens"' in out
    finally:
        cli("template", "delete", "cli-bot")
        cli("template", "delete", "cli-chat")
    failed = subprocess.run(
        [sys.executable, "-m", "gateway.client_cli", "--address", gateway.address, "--api-key", "acme-key",
         "template", "get", "cli-bot"], capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert failed.returncode == 1 and "NOT_FOUND" in failed.stderr


# ---------------------------------------------------------------- faults


def test_without_redis_templates_are_unavailable_and_plain_requests_work(replica, folder):
    server = start_redis(folder)
    gw = start_gateway(replica.address, ["--redis-url", server.url], folder)
    try:
        with GatewayClient(gw.address, timeout_s=60) as client:
            client.create_template("kept", SUPPORT)
            server.stop()
            for label, call in {
                "create": lambda: client.create_template("new", "x"),
                "get": lambda: client.get_template("kept"),
                "list": lambda: list(client.list_templates()),
                "templated request": lambda: client.complete("hi", template="kept"),
            }.items():
                code, message = status_of(call)
                assert code == grpc.StatusCode.UNAVAILABLE, label
                assert "Redis is unreachable" in message, (label, message)
            tokens, _ = completion(client, "The capital of France is", max_new_tokens=3)
            assert len(tokens) == 3
    finally:
        gw.stop()
        server.stop()
        # Its pin is the daemon's until a gateway sees the template gone; free it for the next tests.
        with DaemonClient.connect(replica.daemon.address) as daemon:
            daemon.unpin("template:default/kept")


def test_restarts_keep_templates_warm(stack_factory, workdir, model_dir):
    """Gateway restart (embedded Redis): templates kept. Daemon restart (an empty
    cache): re-warmed and re-pinned. Engine restart: pins kept by the daemon."""
    engine = stack_factory()
    args = ["--data-dir", f"{workdir}/gateway-data"]
    gw = start_gateway(engine.address, args, workdir)
    port = int(gw.address.rsplit(":", 1)[1])
    expected = 0

    def cached_after_template() -> int:
        with GatewayClient(gw.address, timeout_s=60) as client:
            return completion(client, " Hi!", template="doc", max_new_tokens=1)[1].cached_prompt_tokens

    def pins() -> int:
        with DaemonClient.connect(engine.daemon.address) as daemon:
            return daemon.stats().num_pins

    try:
        with GatewayClient(gw.address, timeout_s=60) as client:
            expected = client.create_template("doc", SUPPORT).cached_token_count
        assert expected > 0 and cached_after_template() >= expected

        gw.stop()
        gw = start_gateway(engine.address, args, workdir, port=port)
        with GatewayClient(gw.address) as client:
            assert client.get_template("doc").content == SUPPORT
        assert cached_after_template() >= expected

        folder = engine.daemon.socket_path.rsplit("/", 1)[0]
        engine.daemon.stop()
        engine.daemon = start_daemon(["--block-size", "16", "--lease-s", "2"], folder)
        assert wait_for(lambda: pins() == 1, 30), f"not re-pinned after the daemon restart: {gw.log()}"
        assert cached_after_template() >= expected

        engine.stop()
        engine_port = int(engine.address.rsplit(":", 1)[1])
        engine = start_engine(engine.daemon, ["--model", str(model_dir)], workdir, port=engine_port)
        assert pins() == 1
        # The gateway reconnects within its backoff (at most a second).
        assert wait_for(lambda: health_status(gw.address) == health_pb2.HealthCheckResponse.SERVING, 10)
        assert cached_after_template() >= expected
    finally:
        gw.stop()
        engine.stop()
        engine.daemon.stop()


def test_tls(replica, folder):
    cert, key = Path(folder) / "cert.pem", Path(folder) / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    http = f"127.0.0.1:{free_port()}"
    args = ["--tls-cert", str(cert), "--tls-key", str(key), "--http-listen", http]
    gw = start_gateway(replica.address, args, folder, wait=False)
    try:
        with GatewayClient(gw.address, root_certificates=cert, timeout_s=60) as client:
            assert wait_for(lambda: _answers(client), 30), gw.log()
            info = client.info()
            assert info.block_size == BLOCK
        with GatewayClient(gw.address, timeout_s=5) as plaintext:
            assert status_of(plaintext.info)[0] == grpc.StatusCode.UNAVAILABLE
        # The HTTP API serves HTTPS with the same certificate (curl, as a user would call it).
        models = subprocess.run(["curl", "--silent", "--show-error", "--cacert", str(cert), f"https://{http}/v1/models"],
                                capture_output=True, text=True, timeout=30)  # fmt: skip
        assert models.returncode == 0, models.stderr
        assert json.loads(models.stdout)["data"][0]["id"] == info.model
        plain = subprocess.run(["curl", "--silent", f"http://{http}/v1/models"], capture_output=True, timeout=30)
        assert plain.returncode != 0 or not plain.stdout.startswith(b"{")  # plain HTTP gets no answer
    finally:
        gw.stop()


def _serving(address: str) -> bool:
    """The gateway is up and has an engine attached to its daemon behind it."""
    try:
        return health_status(address) == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


def _answers(client: GatewayClient) -> bool:
    try:
        client.info()
        return True
    except grpc.RpcError:
        return False


def test_make_serve_stack_starts_its_processes_replaces_engines_and_stops_them(workdir, model_dir):
    """`kvd-serve` (what `make serve` runs) with two engines: a templated request
    through its gateway, SIGHUP replaces the engines one at a time while a
    client keeps asking (no request fails), then Ctrl-C."""
    gateway_port, engine_port = free_port(), free_port()
    while not free_port_at(engine_port + 1):
        engine_port = free_port()
    env = {
        **os.environ,
        "KVD_SOCKET": f"{workdir}/serve.sock",
        "KVD_SHM_DIR": workdir,
        "KVD_METRICS_PORT": "0",
        "KVD_DATA_DIR": f"{workdir}/data",
        "KVD_MODEL": str(model_dir),
        "KVD_NUM_BLOCKS": "256",
        "KVD_HTTP_LISTEN": f"127.0.0.1:{free_port()}",
    }
    cmd = [sys.executable, "-m", "inference.stack", "--gateway", f"127.0.0.1:{gateway_port}",
           "--engine", f"127.0.0.1:{engine_port}", "--engines", "2"]  # fmt: skip
    stack = spawn(cmd, f"{workdir}/serve.log", env)
    try:
        client_address = f"127.0.0.1:{gateway_port}"
        with GatewayClient(client_address, timeout_s=60) as client:
            assert wait_for(lambda: _serving(client_address), 180), Path(f"{workdir}/serve.log").read_text()
            client.create_template("hello", SUPPORT)
            _, usage = completion(client, " Hi", template="hello", max_new_tokens=2)
            assert usage.cached_prompt_tokens >= usage.template_tokens // BLOCK * BLOCK > 0
            stack.send_signal(signal.SIGHUP)
            log_path = Path(f"{workdir}/serve.log")
            replaced = lambda: log_path.read_text().count("serves again") == 2  # noqa: E731
            while not replaced():
                assert stack.poll() is None, log_path.read_text()
                _, usage = completion(client, " Still there?", template="hello", max_new_tokens=2)
                assert usage.cached_prompt_tokens >= usage.template_tokens // BLOCK * BLOCK > 0
        stack.send_signal(signal.SIGINT)
        assert stack.wait(timeout=60) == 0
    finally:
        stop_process(stack, signal.SIGKILL)  # and its children, with their process group
    log = Path(f"{workdir}/serve.log").read_text()
    assert "gateway on 127.0.0.1" in log and "single-user mode" in log
    assert f"http://{env['KVD_HTTP_LISTEN']}/v1" in log
    assert f"engines on 127.0.0.1:{engine_port}, 127.0.0.1:{engine_port + 1}" in log


def test_concurrent_templated_requests(acme):
    acme.create_template("concurrent", SUPPORT)
    results: dict[int, list[int]] = {}
    try:

        def ask(i: int) -> None:
            results[i] = completion(acme, f" Question {i}: what do you sell?", template="concurrent")[0]

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert sorted(results) == [0, 1, 2, 3]
        assert results[2] == completion(acme, " Question 2: what do you sell?", template="concurrent")[0]
    finally:
        acme.delete_template("concurrent")


def _missing(call: Callable[[], object]) -> bool:
    """Whether ``call`` fails with NOT_FOUND (False while it still succeeds)."""
    try:
        call()
    except grpc.RpcError as err:
        return err.code() == grpc.StatusCode.NOT_FOUND
    return False
