"""Faults of whole processes under load, through the gateway.

One stack for the module: a private redis-server with AOF, a daemon, a
float64 engine on a fixed port and a gateway. Each test runs greedy requests
through the gateway from a few client threads, injects one fault, recovers,
and checks: every completed response equals transformers' ``generate``
(exact in float64); requests caught in the fault end with the documented
status; no block is held by requests afterwards; new requests succeed.
Tests leave the stack whole for the next one.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2

from gateway.client import GatewayClient
from inference import model_store
from inference.config import EngineSettings
from kvd.common.client import DaemonClient
from kvd_api.daemon.v1 import daemon_pb2 as pb
from kvd_api.engine.v1 import engine_pb2 as epb
from tests.conftest import (
    RedisProcess,
    blocks_held,
    free_port,
    health_status,
    start_daemon,
    start_engine,
    start_gateway,
    wait_for,
)
from tests.integration.engine_client import reference_greedy, stub

DAEMON_ARGS = ["--block-size", "16", "--num-blocks", "1024", "--lease-s", "2"]
TEMPLATE = "You are the dispatcher of the northern harbour. Answer in one short sentence. " * 2
PROMPTS = [[100 + 7 * i + j for j in range(20 + 5 * i)] for i in range(4)]
LONG_PROMPT = [200 + j % 3000 for j in range(2000)]
NEW_TOKENS = 6
SERVING = health_pb2.HealthCheckResponse.SERVING


@dataclass
class Stack:
    folder: Path
    redis: RedisProcess
    daemon: object
    engine: object
    gateway: object
    engine_port: int
    gateway_port: int
    model_dir: Path

    def start_engine(self) -> None:
        self.engine = start_engine(
            self.daemon, ["--model", str(self.model_dir), "--dtype", "float64"], str(self.folder), port=self.engine_port
        )

    def start_gateway(self) -> None:
        args = ["--redis-url", self.redis.url]
        self.gateway = start_gateway(self.engine.address, args, str(self.folder), port=self.gateway_port)

    def client(self, timeout_s: float = 120) -> GatewayClient:
        return GatewayClient(self.gateway.address, timeout_s=timeout_s)


@pytest.fixture(scope="module")
def stack(model_dir):
    folder = Path(tempfile.mkdtemp(prefix="kvd-faults-", dir="/tmp"))
    redis_server = RedisProcess(folder, append_only=True, append_log=True)
    s = Stack(folder, redis_server, None, None, None, free_port(), free_port(), model_dir)
    s.redis.start()
    s.daemon = start_daemon(DAEMON_ARGS, str(folder))
    s.start_engine()
    s.start_gateway()
    with s.client() as client:
        client.create_template("dispatch", TEMPLATE)
    yield s
    s.gateway.stop()
    s.engine.stop()
    s.daemon.stop()
    s.redis.stop()
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def expected(stack, model_dir):
    """transformers' greedy tokens for each (templated?, prompt)."""
    import torch

    template_ids = list(stub(stack.engine.address).Tokenize(epb.TokenizeRequest(text=TEMPLATE), timeout=60).token_ids)
    model = model_store.load_model(model_dir, torch.float64)
    out = {}
    for i, prompt in enumerate(PROMPTS):
        out[(False, i)] = reference_greedy(model, prompt, NEW_TOKENS)
        out[(True, i)] = reference_greedy(model, template_ids + prompt, NEW_TOKENS)
    del model
    return out


@dataclass
class Load:
    """Client threads sending greedy requests (plain and templated) until stopped."""

    stack: Stack
    threads: int = 3
    results: list[tuple[tuple[bool, int], list[int] | None, grpc.StatusCode]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _workers: list[threading.Thread] = field(default_factory=list)

    def __enter__(self) -> Load:
        for n in range(self.threads):
            worker = threading.Thread(target=self._run, args=(n,), daemon=True)
            worker.start()
            self._workers.append(worker)
        return self

    def _run(self, n: int) -> None:
        i = n
        while not self._stop.is_set():
            key = (i % 2 == 0, i % len(PROMPTS))
            i += 1
            try:
                with self.stack.client(timeout_s=60) as client:
                    template = "dispatch" if key[0] else ""
                    reply = client.complete(PROMPTS[key[1]], template=template, max_new_tokens=NEW_TOKENS,
                                            ignore_eos=True)  # fmt: skip
                self.results.append((key, list(reply.token_ids), grpc.StatusCode.OK))
            except grpc.RpcError as err:
                self.results.append((key, None, err.code()))
                time.sleep(0.1)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for worker in self._workers:
            worker.join(timeout=120)

    def statuses(self) -> set[grpc.StatusCode]:
        return {status for _, _, status in self.results}

    def check(self, expected, allowed: set[grpc.StatusCode]) -> None:
        completed = [(key, tokens) for key, tokens, status in self.results if status == grpc.StatusCode.OK]
        assert completed, "no request completed"
        for key, tokens in completed:
            assert tokens == expected[key], key
        assert self.statuses() <= {grpc.StatusCode.OK, *allowed}, self.statuses()


def _settled(stack: Stack) -> None:
    """Nothing held by requests once the load stopped; the template pinned."""
    assert wait_for(lambda: blocks_held(stack.daemon) == 0, 30), "blocks still held by requests"


def _serves(stack: Stack, expected) -> None:
    with stack.client() as client:
        reply = client.complete(PROMPTS[0], template="dispatch", max_new_tokens=NEW_TOKENS, ignore_eos=True)
    assert list(reply.token_ids) == expected[(True, 0)]
    assert reply.usage.cached_prompt_tokens >= 16  # the template is warm


def _sessions(stack: Stack) -> int:
    with DaemonClient.connect(stack.daemon.address) as client:
        return client.stats().num_sessions


def _pins(stack: Stack) -> int:
    with DaemonClient.connect(stack.daemon.address) as client:
        return client.stats().num_pins


def test_engine_killed_mid_stream_and_restarted(stack, expected):
    with Load(stack) as load:
        assert wait_for(lambda: len(load.results) >= 3, 120)
        stack.engine.stop(signal.SIGKILL)
        assert wait_for(lambda: blocks_held(stack.daemon) == 0, 15), "the dead engine's blocks stayed held"
        assert _pins(stack) == 1  # the daemon keeps the template's pin
        stack.start_engine()
        assert wait_for(lambda: health_status(stack.gateway.address) == SERVING, 30)
        done = len(load.results)
        assert wait_for(lambda: len(load.results) >= done + 3, 120)
    load.check(expected, {grpc.StatusCode.UNAVAILABLE})
    _settled(stack)
    _serves(stack, expected)


def test_daemon_killed_and_restarted(stack, expected):
    with Load(stack) as load:
        assert wait_for(lambda: len(load.results) >= 3, 120)
        stack.daemon.stop(signal.SIGKILL)
        stack.daemon = start_daemon(DAEMON_ARGS, str(stack.folder))
        # The engine re-attaches; the gateway's keeper sees a new cache and re-warms the template.
        assert wait_for(lambda: _pins(stack) == 1, 60), stack.gateway.log()[-2000:]
        done = len(load.results)
        assert wait_for(lambda: len(load.results) >= done + 3, 120)
    load.check(expected, {grpc.StatusCode.UNAVAILABLE})
    _settled(stack)
    _serves(stack, expected)


def test_gateway_killed_and_restarted(stack, expected):
    stack.gateway.stop(signal.SIGKILL)
    stack.start_gateway()
    # Templates live in Redis; the first request is served at once.
    with stack.client() as client:
        assert client.get_template("dispatch").content == TEMPLATE
    _serves(stack, expected)
    _settled(stack)


def test_redis_stopped_and_restarted(stack, expected):
    with Load(stack, threads=2) as load:
        assert wait_for(lambda: len(load.results) >= 2, 120)
        stack.redis.stop()
        with stack.client() as client:
            with pytest.raises(grpc.RpcError) as info:
                client.get_template("dispatch")
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            # Plain generation keeps working without Redis.
            reply = client.complete(PROMPTS[1], max_new_tokens=NEW_TOKENS, ignore_eos=True)
            assert list(reply.token_ids) == expected[(False, 1)]
        stack.redis.start()
        done = len(load.results)
        assert wait_for(lambda: len(load.results) >= done + 3, 120)
    load.check(expected, {grpc.StatusCode.UNAVAILABLE})
    with stack.client() as client:
        assert client.get_template("dispatch").content == TEMPLATE  # the AOF kept it
    _settled(stack)
    _serves(stack, expected)


def test_engine_stopped_mid_forward_past_its_lease_never_writes_into_blocks_it_lost(stack, expected):
    """A SIGSTOP that lands inside a forward, for longer than the lease: the
    daemon quarantines the lapsed session's blocks (kvd/quarantine.py) rather
    than handing them out, so a bystander session that takes every free block
    meanwhile finds its bytes untouched after the engine resumes; the engine
    stops the forward at its next layer's lease check, detaches (ending the
    quarantine), re-attaches and serves exact tokens again."""
    with stack.client() as client:
        # Four 512-token prefill chunks in float64: the engine spends nearly
        # all of its time inside forwards, so the stop lands in one.
        stream = client.generate(LONG_PROMPT, max_new_tokens=4, ignore_eos=True)
        assert wait_for(lambda: blocks_held(stack.daemon) > 0, 60)  # its first forward began
        time.sleep(0.3)
        stack.engine.process.send_signal(signal.SIGSTOP)
        try:
            # The lease (2 s) lapses: the session is gone, its blocks held back.
            assert wait_for(lambda: _quarantine(stack) == (1, True), 15), _quarantine(stack)
            with DaemonClient.connect(stack.daemon.address) as daemon:
                assert daemon.stats().num_sessions == 0
                bystander = daemon.attach("bystander")
                try:
                    blocks = _take_every_free_block(bystander)
                    bystander.cache[blocks] = 7.0
                    stack.engine.process.send_signal(signal.SIGCONT)
                    # The engine gives up its forward, detaches and attaches anew.
                    assert wait_for(lambda: _quarantine(stack) == (0, False) and _sessions(stack) == 2, 30)
                    assert bool((bystander.cache[blocks] == 7.0).all()), "the stopped engine wrote into lost blocks"
                finally:
                    bystander.detach()
        finally:
            stack.engine.process.send_signal(signal.SIGCONT)
        # The request caught in it had streamed nothing: the engine ended it
        # UNAVAILABLE and the gateway held it until the engine served again
        # (docs/deploy.md, the gateway's rule); its answer is the stack's own.
        caught = [t for message in stream for t in message.token_ids]
        assert "request waits for a replica to serve" in stack.gateway.log()
        again = client.complete(LONG_PROMPT, max_new_tokens=4, ignore_eos=True)
        assert caught == list(again.token_ids) and len(caught) == 4
    assert wait_for(lambda: health_status(stack.engine.address) == SERVING, 30)
    assert wait_for(lambda: health_status(stack.gateway.address) == SERVING, 60)  # its health rounds saw it
    with Load(stack) as load:
        assert wait_for(lambda: len(load.results) >= 4, 120)
    load.check(expected, set())
    _settled(stack)
    _serves(stack, expected)


def _quarantine(stack: Stack) -> tuple[int, bool]:
    """Quarantined sessions, and whether they hold blocks."""
    with DaemonClient.connect(stack.daemon.address) as client:
        stats = client.stats()
    return stats.num_quarantined_sessions, stats.num_quarantined_blocks > 0


def _take_every_free_block(session) -> list[int]:
    """One request whose prompt needs every free block, scheduled whole; its block ids."""
    free = session.step(pb.StepRequest()).num_free_blocks
    prompt = [1000 + i % 5000 for i in range(free * 16)]
    reply = session.step(
        pb.StepRequest(
            settings=pb.SessionSettings(max_num_seqs=1, token_budget=len(prompt)),
            new_requests=[pb.NewRequest(request_id="hog", prompt_token_ids=prompt, max_new_tokens=1)],
        )
    )
    blocks = list(reply.scheduled.new_block_ids)
    assert len(blocks) == free, (len(blocks), free)
    return blocks


def test_500_abandoned_streams_release_every_block(stack, expected):
    """500 streams: stream 0, then 499 at once; the engine takes its
    --max-open-requests (stream 0 among them, streaming) and refuses the rest with RESOURCE_EXHAUSTED,
    none waiting unseen; then the client vanishes and every block comes back."""
    open_limit = EngineSettings.max_open_requests
    client = textwrap.dedent(
        f"""
        import time
        import grpc
        from kvd_api.engine.v1 import engine_pb2 as epb
        from kvd_api.gateway.v1 import gateway_pb2 as pb, gateway_pb2_grpc as pbg
        gateway = pbg.GatewayStub(grpc.insecure_channel("{stack.gateway.address}"))
        def generate(i):
            return gateway.Generate(pb.GenerateRequest(token_ids=epb.TokenIds(ids=[5, 6, 7, i % 50 + 10]),
                                    sampling=epb.SamplingParams(max_new_tokens=500, ignore_eos=True)))
        # Stream 0 streams before the others are sent: it holds its place
        # whatever the order in which the rest reach the engine.
        first = generate(0)
        next(first)
        streams = [first] + [generate(i) for i in range(1, 500)]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and sum(s.done() for s in streams) < {500 - open_limit}:
            time.sleep(0.1)
        print(sorted({{s.code().name for s in streams if s.done()}}), sum(s.done() for s in streams), flush=True)
        input()
        """
    )
    process = subprocess.Popen([sys.executable, "-c", client], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().strip() == f"['RESOURCE_EXHAUSTED'] {500 - open_limit}"
        assert blocks_held(stack.daemon) > 0
    finally:
        process.kill()  # vanishes: no cancel, no close
        process.wait()
    assert wait_for(lambda: blocks_held(stack.daemon) == 0, 120), "abandoned streams kept blocks"
    with DaemonClient.connect(stack.daemon.address) as daemon:
        assert daemon.stats().num_requests == 0
    _serves(stack, expected)
