"""Engines come and go, the cache stays: two engines on one daemon behind a
gateway (the real model, float64: exact against `generate`), a template
pinned once per cache across its engine's drain, a rolling replacement under
steady load that loses no request and recomputes no prefix, the Drain call,
and fairness between two engines' sessions.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import json
import shutil
import signal
import tempfile
import threading
import time

import grpc
import httpx2 as httpx
import pytest
from grpc_health.v1 import health_pb2

from gateway.client import GatewayClient
from kvd.common.client import DaemonClient
from kvd_api.engine.v1 import engine_pb2 as epb
from tests.conftest import (
    blocks_held,
    free_port,
    gateway_on_local_redis,
    health_status,
    start_daemon,
    start_engine,
    wait_for,
)
from tests.integration import engine_client
from tests.integration.gateway_client import completion, document

BLOCK = 16
ENGINE_ARGS = ["--dtype", "float64"]


@pytest.fixture(scope="module")
def folder():
    path = tempfile.mkdtemp(prefix="kvd-swap-", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def daemon(folder):
    started = start_daemon(["--block-size", str(BLOCK), "--num-blocks", "1024", "--lease-s", "2"], folder)
    yield started
    started.stop()


@pytest.fixture(scope="module")
def engines(daemon, model_dir, folder):
    """Two engines on the one daemon (the list's entries are replaced when a test restarts one)."""
    started = [start_engine(daemon, ["--model", str(model_dir), *ENGINE_ARGS], folder) for _ in range(2)]
    yield started
    for engine in started:
        engine.stop(signal.SIGKILL)


@pytest.fixture(scope="module")
def gateway(engines, folder):
    with gateway_on_local_redis(",".join(e.address for e in engines), folder, replicas=2) as gw:
        yield gw


def restart(engines: list, index: int, daemon, model_dir, folder) -> None:
    """Drains engine ``index`` (SIGTERM), then starts a new one on its address."""
    old = engines[index]
    assert old.stop(signal.SIGTERM, timeout_s=60) == 0, old.log()
    port = int(old.address.rsplit(":", 1)[1])
    engines[index] = start_engine(daemon, ["--model", str(model_dir), *ENGINE_ARGS], folder, port=port)


def pins(daemon) -> int:
    with DaemonClient.connect(daemon.address) as client:
        return client.stats().num_pins


def test_engines_on_one_daemon_serve_as_one_cache(gateway, engines, tokenizer, reference_model):
    shared = tokenizer.encode(document(tokenizer, 96), add_special_tokens=False)
    prompts = [shared + tokenizer.encode(f" Question {i}: who met?", add_special_tokens=False) for i in range(8)]
    work = prompts * 4  # 32 concurrent requests, each prompt four times
    with GatewayClient(gateway.address, timeout_s=300) as client, cf.ThreadPoolExecutor(len(work)) as pool:
        outputs = list(pool.map(lambda ids: completion(client, ids, max_new_tokens=4)[0], work))
    expected = [engine_client.reference_greedy(reference_model, ids, 4) for ids in prompts]
    assert outputs == expected * 4

    # A prefix one engine computed is a hit on the other.
    prefix = tokenizer.encode("Minutes of the harbour board. " + document(tokenizer, 64), add_special_tokens=False)
    first, second = (engine_client.stub(e.address) for e in engines)
    _, _, last = engine_client.generate(first, engine_client.request([*prefix, 7], 2))
    assert last.usage.cached_prompt_tokens == 0
    _, _, last = engine_client.generate(second, engine_client.request([*prefix, 9], 2))
    assert last.usage.cached_prompt_tokens == len(prefix) // BLOCK * BLOCK > 0
    caches = {engine_client.stub(e.address).Info(epb.InfoRequest()).cache_id for e in engines}
    assert len(caches) == 1


def test_a_rolling_replacement_under_load_loses_no_request_and_recomputes_no_prefix(
    gateway, engines, daemon, model_dir, folder, tokenizer
):
    """Clients stream plain and templated requests while each engine in turn
    drains and comes back: no request fails, the cached share stays, the
    template stays pinned once in the cache both engines share."""
    shared = "Annual report of the river authority. " + document(tokenizer, 128)
    results: list[tuple[str, int, int]] = []  # (phase, cached tokens, prompt tokens)
    failures: list[str] = []
    phase = {"now": "before"}
    stop = threading.Event()

    def client_loop(n: int) -> None:
        with GatewayClient(gateway.address, timeout_s=120) as client:
            i = 0
            while not stop.is_set():
                i += 1
                prompt, template = (
                    (f" Client {n}, entry {i}?", "log") if i % 2 else (shared + f" Question {n}.{i}?", "")
                )
                try:
                    tokens, usage = [], None
                    for message in client.generate(prompt, template=template, max_new_tokens=4,
                                                   ignore_eos=True):  # fmt: skip
                        tokens.extend(message.token_ids)
                        if message.HasField("usage"):
                            usage = message.usage
                    assert usage is not None and len(tokens) == 4
                    results.append((phase["now"], usage.cached_prompt_tokens, usage.prompt_tokens))
                except grpc.RpcError as err:
                    failures.append(f"{err.code().name}: {err.details()}")

    with GatewayClient(gateway.address, timeout_s=120) as client:
        client.create_template("log", "Maintenance log of the east pumping station. " + document(tokenizer, 80))
        assert pins(daemon) == 1
        assert [r.templates for r in client.info().replicas] == [1, 1]  # one pin, in the cache both share
        threads = [threading.Thread(target=client_loop, args=(n,)) for n in range(3)]
        for t in threads:
            t.start()
        try:
            assert wait_for(lambda: len(results) >= 6, 120)
            phase["now"] = "during"
            for index in range(len(engines)):  # one engine at a time: drained, started again
                restart(engines, index, daemon, model_dir, folder)
                assert wait_for(lambda: sum(r.serving for r in client.info().replicas) == 2, 30), gateway.log()
                time.sleep(0.6)  # keeper rounds (0.2 s each) with both replicas of the one cache again
                assert pins(daemon) == 1, gateway.log()
            phase["now"] = "after"
            count = len(results)
            assert wait_for(lambda: len(results) >= count + 6, 120)
        finally:
            stop.set()
            for t in threads:
                t.join(120)
        client.delete_template("log")
    assert failures == [], failures[:5]

    def share(name: str) -> float:
        rows = [(c, p) for ph, c, p in results if ph == name]
        return sum(c for c, _ in rows) / sum(p for _, p in rows)

    assert share("after") >= 0.9 * share("before") > 0, (share("before"), share("after"))
    assert wait_for(lambda: pins(daemon) == 0 and blocks_held(daemon) == 0, 15)


def test_a_drain_hands_back_what_has_not_started_and_the_gateway_retries_it_elsewhere(model_dir, workdir, tokenizer):
    """Engine A (one seat) runs a long request; two requests wait behind it, one
    sent to A directly and one through a round-robin gateway. Draining A hands
    both back before their first token: the direct one ends UNAVAILABLE, the
    gateway's is retried on engine B and succeeds; the long one runs to its end."""
    daemon = start_daemon(["--block-size", str(BLOCK), "--num-blocks", "256"], workdir)
    args = ["--model", str(model_dir), *ENGINE_ARGS, "--max-num-seqs", "1"]
    a, b = start_engine(daemon, args, workdir), start_engine(daemon, args, workdir)
    engines = f"{a.address},{b.address}"
    try:
        with gateway_on_local_redis(engines, workdir, 2, ["--routing", "round-robin"]) as gateway:
            stub = engine_client.stub(a.address)
            running_prompt = tokenizer.encode(document(tokenizer, 48), add_special_tokens=False)
            running = stub.Generate(engine_client.request(running_prompt, 40))
            first = next(running)  # admitted and streaming: A's one seat is taken
            waiting = stub.Generate(engine_client.request([5, 6, 7, 8], 4))
            with GatewayClient(gateway.address, timeout_s=120) as client, cf.ThreadPoolExecutor(2) as pool:
                routed = [pool.submit(completion, client, [9, 10, 11, i], max_new_tokens=3) for i in range(2)]
                assert wait_for(lambda: any(f.done() for f in routed), 60)  # B's; A's waits behind the long one
                reply = stub.Drain(epb.DrainRequest(timeout_s=120), timeout=180)
                assert [len(f.result(timeout=60)[0]) for f in routed] == [3, 3]  # A's was retried on B
            assert "request handed to another replica" in gateway.log()
        assert (reply.handed_back, reply.cut_short) == (2, 0), reply
        with pytest.raises(grpc.RpcError) as refused:
            next(waiting)  # nothing streamed before the error: a router may retry it elsewhere
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in refused.value.details()
        rest = list(running)
        assert len(first.token_ids) + sum(len(m.token_ids) for m in rest) == 40  # ran to its end
        assert a.process.wait(timeout=30) == 0
        with DaemonClient.connect(daemon.address) as client:
            assert wait_for(lambda: client.stats().num_used_blocks == 0, 10)
            kept = client.device_cached_tokens(running_prompt)
            assert kept == len(running_prompt) // BLOCK * BLOCK  # the cache kept it
    finally:
        a.stop()
        b.stop()
        daemon.stop()


def test_requests_that_find_no_replica_serving_wait_for_the_replaced_one_on_every_call_type(
    model_dir, workdir, tokenizer, reference_model
):
    """The gateway's rule during a replacement (docs/deploy.md): engine B
    drains (a long request keeps it alive, refusing new ones) and engine A is
    replaced, while the gateway still takes both for serving (its health
    rounds are an hour apart). Requests of every kind (gRPC Complete and
    Generate with no deadline, HTTP chat streaming, CreateTemplate's warm) are
    refused by both, wait, and go to the new A on A's address as soon as it
    serves: none fails, each answer is the reference's."""
    daemon = start_daemon(["--block-size", str(BLOCK), "--num-blocks", "256"], workdir)
    args = ["--model", str(model_dir), *ENGINE_ARGS]
    a, b = start_engine(daemon, args, workdir), start_engine(daemon, args, workdir)
    http = f"127.0.0.1:{free_port()}"
    rounds = ["--health-interval-s", "3600", "--replica-wait-s", "600", "--routing", "round-robin"]
    prompt = tokenizer.encode(" The harbour master said", add_special_tokens=False)
    try:
        with gateway_on_local_redis(f"{a.address},{b.address}", workdir, 2, [*rounds, "--http-listen", http]) as gw:
            with GatewayClient(gw.address) as client:  # what the gateway fetches once: the tokenizer, model info
                client.create_template("first", "Log of the lock keepers.")
                client.delete_template("first")
                model = client.info().model
            assert _http_chat_stream(http, model)[0] == 200
            held = engine_client.stub(b.address).Generate(engine_client.request([5, 6, 7, 8], 2000))
            next(held)  # B runs it to its end while it drains
            b.process.send_signal(signal.SIGTERM)
            assert wait_for(lambda: health_status(b.address) == health_pb2.HealthCheckResponse.NOT_SERVING, 60)
            assert a.stop(signal.SIGTERM, timeout_s=60) == 0, a.log()
            with GatewayClient(gw.address, timeout_s=None) as client, cf.ThreadPoolExecutor(4) as pool:
                calls = {
                    "complete": pool.submit(lambda: list(client.complete(prompt, max_new_tokens=6).token_ids)),
                    "generate": pool.submit(
                        lambda: [t for m in client.generate(prompt, max_new_tokens=6) for t in m.token_ids]
                    ),
                    "http": pool.submit(_http_chat_stream, http, model),
                    "template": pool.submit(lambda: client.create_template("swap", "Log of the lock keepers.")),
                }
                waits = lambda: gw.log().count("request waits for a replica to serve")  # noqa: E731
                assert wait_for(lambda: waits() >= len(calls), 120), gw.log()
                assert not any(call.done() for call in calls.values())
                port = int(a.address.rsplit(":", 1)[1])
                a = start_engine(daemon, args, workdir, port=port)
                expected = engine_client.reference_greedy(reference_model, prompt, 6)
                assert calls["complete"].result(timeout=120) == expected
                assert calls["generate"].result(timeout=120) == expected
                assert calls["http"].result(timeout=120) in [(200, "stop"), (200, "length")]
                assert calls["template"].result(timeout=120).name == "swap"
                client.delete_template("swap")
            held.cancel()
            assert b.process.wait(timeout=60) == 0
    finally:
        a.stop()
        b.stop(signal.SIGKILL)
        daemon.stop()


def test_requests_a_stopping_engine_had_not_started_are_retried_not_cancelled(model_dir, workdir):
    """A gRPC server that stops cancels the calls it had received but not yet
    taken up (grpc/grpc#41785): CANCELLED, though nobody cancelled. Engine A
    is frozen (SIGSTOP) while the gateway sends it a burst of requests, then
    stopped (SIGTERM, SIGCONT): it takes some up and refuses them while it
    drains (UNAVAILABLE), and its server cancels the rest as it stops. The
    gateway takes both for what they are, the engine going away before the
    request started, and waits for a replica: the new A on A's address
    answers every one."""
    daemon = start_daemon(["--block-size", str(BLOCK), "--num-blocks", "256"], workdir)
    args = ["--model", str(model_dir)]
    a = start_engine(daemon, args, workdir)
    rounds = ["--health-interval-s", "3600", "--replica-wait-s", "600"]
    try:
        with gateway_on_local_redis(a.address, workdir, 1, rounds) as gw:
            with GatewayClient(gw.address, timeout_s=None) as client, cf.ThreadPoolExecutor(BURST) as pool:
                client.info()  # what the gateway fetches once (model info, tokenizer), while A answers
                a.process.send_signal(signal.SIGSTOP)
                asked = [pool.submit(completion, client, [9, 10, 11, i], max_new_tokens=2) for i in range(BURST)]
                time.sleep(2.0)  # the burst waits in A's socket
                a.process.send_signal(signal.SIGTERM)
                a.process.send_signal(signal.SIGCONT)
                assert a.process.wait(timeout=60) == 0, a.log()
                port = int(a.address.rsplit(":", 1)[1])
                a = start_engine(daemon, args, workdir, port=port)
                outcomes = collections.Counter(_outcome(f) for f in asked)
                assert outcomes == {"answered": BURST}, outcomes
            assert "request waits for a replica to serve" in gw.log()
    finally:
        a.process.send_signal(signal.SIGCONT)  # were it still frozen, its stop would wait for nothing
        a.stop()
        daemon.stop()


#: Requests sent to the frozen engine at once.
BURST = 48


def _outcome(asked: cf.Future) -> str:
    try:
        return "answered" if len(asked.result(timeout=120)[0]) == 2 else "short"
    except grpc.RpcError as err:
        return err.code().name


def _http_chat_stream(http: str, model: str) -> tuple[int, str]:
    """A streamed chat completion over HTTP with no timeout: its status and finish reason."""
    body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "stream": True}
    finish = ""
    with httpx.stream("POST", f"http://{http}/v1/chat/completions", json=body, timeout=None) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                finish = json.loads(line[6:])["choices"][0].get("finish_reason") or finish
        return reply.status_code, finish


def test_a_full_engine_refuses_at_once_and_the_gateway_sends_the_request_to_another(model_dir, workdir, tokenizer):
    """Engine A holds one open request (--max-open-requests 1) and is busy with
    it: a second call to A is refused at once with RESOURCE_EXHAUSTED instead of
    waiting unseen; through a round-robin gateway, the request that A refuses is
    served by B; A's health still answers SERVING."""
    daemon = start_daemon(["--block-size", str(BLOCK), "--num-blocks", "256"], workdir)
    args = ["--model", str(model_dir)]
    a = start_engine(daemon, [*args, "--max-open-requests", "1"], workdir)
    b = start_engine(daemon, args, workdir)
    try:
        with gateway_on_local_redis(f"{a.address},{b.address}", workdir, 2, ["--routing", "round-robin"]) as gateway:
            stub = engine_client.stub(a.address)
            held = stub.Generate(engine_client.request([5, 6, 7, 8], 400))
            next(held)
            with pytest.raises(grpc.RpcError) as refused:
                next(stub.Generate(engine_client.request([5, 6, 7, 9], 4), timeout=10))
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "1 requests are open here (--max-open-requests)" in refused.value.details()
            assert health_status(a.address) == health_pb2.HealthCheckResponse.SERVING
            with GatewayClient(gateway.address, timeout_s=120) as client:
                lengths = [len(completion(client, [9, 10, 11, i], max_new_tokens=3)[0]) for i in range(2)]
            assert lengths == [3, 3]  # one of them was A's turn
            assert "request handed to another replica" in gateway.log()
            held.cancel()
        with DaemonClient.connect(daemon.address) as client:
            assert wait_for(lambda: client.stats().num_used_blocks == 0, 10)
    finally:
        a.stop()
        b.stop()
        daemon.stop()


def test_one_engine_flooding_long_prompts_does_not_stall_the_others_short_ones(model_dir, workdir, tokenizer):
    """The daemon's rule: while a session's waiting request does not fit the
    pool, every session is capped at an equal share of it (kvd.session,
    SessionRegistry.fair_share). Bound: the short request ends while most of
    the flood is still to come."""
    daemon = start_daemon(["--block-size", str(BLOCK), "--num-blocks", "48"], workdir)
    args = ["--model", str(model_dir), "--dtype", "float32"]
    hog = start_engine(daemon, [*args, "--max-num-seqs", "8"], workdir)
    meek = start_engine(daemon, args, workdir)
    try:
        flood_stub, meek_stub = engine_client.stub(hog.address), engine_client.stub(meek.address)
        long_prompt = tokenizer.encode(document(tokenizer, 200), add_special_tokens=False)
        flood = [flood_stub.Generate(engine_client.request([*long_prompt, i], 24)) for i in range(24)]
        done = [0]

        def drain(call) -> None:
            for _ in call:
                pass
            done[0] += 1

        with cf.ThreadPoolExecutor(len(flood)) as pool:
            for call in flood:
                pool.submit(drain, call)
            assert wait_for(lambda: done[0] >= 1, 120)
            tokens, _, last = engine_client.generate(meek_stub, engine_client.request([11, 12, 13, 14], 4), 120)
            assert len(tokens) == 4
            assert done[0] <= len(flood) // 2, f"the flood was mostly over ({done[0]} done): nothing was tested"
    finally:
        hog.stop(signal.SIGKILL)
        meek.stop()
        daemon.stop()
