"""Two engine replicas (each with its own daemon) behind one gateway, with the
real Redis at 127.0.0.1:6379 (keys under a prefix of this module's own)."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import tempfile

import grpc
import pytest

from gateway.client import GatewayClient
from kvd.common.client import DaemonClient
from tests.conftest import free_port, gateway_on_local_redis, start_daemon, start_engine, start_gateway, wait_for
from tests.integration import engine_client
from tests.integration.gateway_client import completion, document, status_of

BLOCK = 16
DAEMON_ARGS = ["--block-size", str(BLOCK), "--num-blocks", "512", "--lease-s", "2"]


@pytest.fixture(scope="module")
def folder():
    path = tempfile.mkdtemp(prefix="kvd-rt-", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def replicas(model_dir, folder):
    """Two float64 engines, each on a daemon of its own."""
    started = []
    for name in ("a", "b"):
        os.makedirs(f"{folder}/{name}")
        daemon = start_daemon(DAEMON_ARGS, f"{folder}/{name}")
        started.append(start_engine(daemon, ["--model", str(model_dir), "--dtype", "float64"], f"{folder}/{name}"))
    yield started
    for engine in started:
        engine.stop()
        engine.daemon.stop()


@pytest.fixture(scope="module")
def gateway(replicas, folder):
    # One replica by a dns: name (localhost resolves to 127.0.0.1 here), one by address.
    engines = f"dns:localhost:{replicas[0].address.rsplit(':', 1)[1]},{replicas[1].address}"
    with gateway_on_local_redis(engines, folder, replicas=2) as gw:
        yield gw


def stats(engine):
    with DaemonClient.connect(engine.daemon.address) as daemon:
        return daemon.stats()


def queried(replicas) -> list[int]:
    """Prompt tokens each replica's daemon has looked up (admissions) so far."""
    return [stats(e).query_tokens for e in replicas]


def home_of(client: GatewayClient) -> str | None:
    """The address of the serving replica the (one) template is pinned on."""
    placed = [r.address for r in client.info().replicas if r.serving and r.templates]
    return placed[0] if len(placed) == 1 else None


def test_a_template_and_a_long_prefix_each_stay_on_one_replica(gateway, replicas, tokenizer):
    content = document(tokenizer, 200)
    template_ids = tokenizer.encode(content, add_special_tokens=False)
    with GatewayClient(gateway.address, timeout_s=120) as client:
        client.create_template("doc", content)
        try:
            home = home_of(client)
            assert home is not None, client.info()
            before = queried(replicas)
            for i in range(4):
                _, usage = completion(client, f" Question {i}: when is the next meeting?", template="doc")
                assert usage.cached_prompt_tokens >= len(template_ids) // BLOCK * BLOCK
            moved = [after - b for after, b in zip(queried(replicas), before, strict=True)]
            assert [m > 0 for m in moved] == [e.address == home for e in replicas], moved
        finally:
            client.delete_template("doc")
        assert [stats(e).num_pins for e in replicas] == [0, 0]

        # A long shared prefix of plain text: all on the replica that computed it first.
        shared = document(tokenizer, 160)
        before = queried(replicas)
        cached = [completion(client, shared + f" Item {i}.")[1].cached_prompt_tokens for i in range(4)]
        moved = [after - b for after, b in zip(queried(replicas), before, strict=True)]
        assert sorted(m > 0 for m in moved) == [False, True], moved
        assert min(cached[1:]) >= 144, cached  # the shared blocks were hits after the first

        # Routed outputs are the outputs of the same tokens on the other replica, cold.
        prompt = tokenizer.encode(shared + " Item 9.", add_special_tokens=False)
        routed, _ = completion(client, prompt, max_new_tokens=8)
        cold = next(e for e, m in zip(replicas, moved, strict=True) if m == 0)
        direct, _, _ = engine_client.generate(engine_client.stub(cold.address), engine_client.request(prompt, 8))
        assert routed == direct


def test_a_gateway_started_later_sees_what_the_daemons_hold(gateway, replicas, tokenizer, folder):
    with GatewayClient(gateway.address, timeout_s=120) as client:
        for i in range(2):  # blocks cached before the second gateway exists
            completion(client, document(tokenizer, 64 + 32 * i) + f" Note {i}.", max_new_tokens=2)
    held = [stats(e).num_cached_blocks for e in replicas]
    assert sum(held) > 0

    def views(client: GatewayClient) -> list[int]:
        return [r.known_blocks for r in sorted(client.info().replicas, key=lambda r: r.address)]

    engines = ",".join(e.address for e in replicas)
    args = ["--redis-url", "redis://127.0.0.1:6379/0", "--redis-prefix", f"kvd-test-late-{secrets.token_hex(4)}:",
            "--health-interval-s", "0.2"]  # fmt: skip
    late = start_gateway(engines, args, folder)
    try:
        order = sorted(range(len(replicas)), key=lambda i: replicas[i].address)
        wanted = [held[i] for i in order]
        with GatewayClient(late.address, timeout_s=60) as late_client, GatewayClient(gateway.address) as first:
            assert wait_for(lambda: views(late_client) == wanted, 20), (views(late_client), wanted, late.log())
            assert views(first) == wanted  # the one that saw the events live agrees
    finally:
        late.stop()


def test_a_replica_that_dies_is_routed_around_and_comes_back_rewarmed(gateway, replicas, tokenizer, model_dir):
    # NOTE: its own first words: every document() shares its first blocks, which the
    # earlier tests left cached on both replicas, and a prefix both hold costs the
    # same on either (cost routing may then pick the stand-in).
    content = "Operations handbook, night shift. " + document(tokenizer, 120)
    with GatewayClient(gateway.address, timeout_s=120) as client:
        client.create_template("ops", content)
        home = home_of(client)
        assert home is not None, client.info()
        index = next(i for i, e in enumerate(replicas) if e.address == home)
        dead, other = replicas[index], replicas[1 - index]
        # A generation in flight on the dying replica fails, and is not retried.
        stream = client.generate(" Tell me everything.", template="ops", max_new_tokens=2000, ignore_eos=True)
        next(stream)
        dead.stop(signal.SIGKILL)
        dead.daemon.stop(signal.SIGKILL)
        with pytest.raises(grpc.RpcError) as failed:
            list(stream)
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE

        # New requests go to the other replica, where the template is placed now.
        assert wait_for(lambda: home_of(client) == other.address, 20), gateway.log()
        _, usage = completion(client, " Status?", template="ops")
        assert usage.cached_prompt_tokens >= usage.template_tokens // BLOCK * BLOCK > 0
        assert len(completion(client, "The capital of France is", max_new_tokens=2)[0]) == 2

        # Back with an empty cache: re-warmed there (first in the template's
        # order), and unpinned from the replica that stood in.
        workdir = dead.daemon.socket_path.rsplit("/", 1)[0]
        daemon = start_daemon(DAEMON_ARGS, workdir)
        port = int(dead.address.rsplit(":", 1)[1])
        replicas[index] = start_engine(daemon, ["--model", str(model_dir), "--dtype", "float64"], workdir, port=port)
        assert wait_for(lambda: home_of(client) == home and stats(other).num_pins == 0, 30), gateway.log()
        assert stats(replicas[index]).num_pins == 1
        before = queried(replicas)
        _, usage = completion(client, " Status again?", template="ops")
        assert usage.cached_prompt_tokens >= usage.template_tokens // BLOCK * BLOCK
        assert queried(replicas)[1 - index] == before[1 - index]
        client.delete_template("ops")


def test_without_any_serving_replica_requests_are_unavailable(folder):
    engines = f"127.0.0.1:{free_port()},dns:no-such-host.invalid:50052"
    gw = start_gateway(engines, ["--data-dir", f"{folder}/gateway-data"], folder, wait=False)
    try:
        with GatewayClient(gw.address, timeout_s=10) as client:
            assert wait_for(lambda: _answers(client), 20), gw.log()
            code, message = status_of(lambda: client.complete("hi", max_new_tokens=1))
            assert code == grpc.StatusCode.UNAVAILABLE and "no engine replica is serving" in message
    finally:
        gw.stop()


def _answers(client: GatewayClient) -> bool:
    try:
        client.complete("hi", max_new_tokens=1)
    except grpc.RpcError as err:
        return err.code() == grpc.StatusCode.UNAVAILABLE and "no engine replica" in (err.details() or "")
    return False
