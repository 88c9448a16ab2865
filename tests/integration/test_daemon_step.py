"""Step semantics through the daemon's gRPC API (4-token blocks, 32 blocks)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvd.step import AdmissionWork, AppendWork, CommitWork, StepInput
from kvd_api.daemon.v1 import daemon_pb2 as pb


def admit(session, request_id, tokens, budget=1000, salt=b""):
    return session.step(StepInput(admissions=[AdmissionWork(request_id, tokens, salt)], token_budget=budget))


def run_to_completion(session, request_id, tokens, salt=b""):
    """Admits, computes the whole prompt, commits and frees: the blocks are cached."""
    reply = admit(session, request_id, tokens, salt=salt)
    assert reply.scheduled[0].num_scheduled_tokens + reply.scheduled[0].first_position == len(tokens)
    session.step(StepInput(commits=[CommitWork(request_id, len(tokens))]))
    session.step(StepInput(frees=[request_id]))
    return reply.scheduled[0]


def cached_tokens(client, tokens, salt=b""):
    return client.stub.Lookup(pb.LookupRequest(token_ids=tokens, cache_salt=salt)).num_cached_tokens


def test_a_shared_prefix_is_served_from_the_cache(daemon):
    client = daemon.client()
    session = client.attach("engine")
    prefix = list(range(100, 112))  # 3 full blocks
    first = run_to_completion(session, "a", prefix + [1, 2, 3, 4, 5])
    assert first.num_cached_tokens == 0
    second = admit(session, "b", prefix + [9, 9, 9]).scheduled[0]
    assert second.num_cached_tokens == 12 and second.first_position == 12 and second.num_scheduled_tokens == 3
    assert client.stats().hit_tokens == 12
    # Another tenant's salt never hits.
    third = admit(session, "c", prefix + [9], salt=b"tenant-b").scheduled[0]
    assert third.num_cached_tokens == 0


def test_the_budget_counts_only_uncached_tokens_and_chunks_the_rest(daemon):
    session = daemon.client().attach("engine")
    prefix = list(range(200, 216))  # 4 blocks
    run_to_completion(session, "a", prefix + [1])
    reply = admit(session, "b", prefix + list(range(10)), budget=6)
    s = reply.scheduled[0]
    assert (s.num_cached_tokens, s.first_position, s.num_scheduled_tokens) == (16, 16, 6)
    assert len(s.new_block_ids) == 4 + 2  # the hits, then blocks for 6 new tokens only
    nxt = session.step(
        StepInput(commits=[CommitWork("b", 22)], appends=[AppendWork("b", 4)], token_budget=6)
    ).scheduled[0]
    assert (nxt.first_position, nxt.num_scheduled_tokens, len(nxt.new_block_ids)) == (22, 4, 1)


def test_a_fully_cached_prompt_computes_only_its_last_token(daemon):
    session = daemon.client().attach("engine")
    prompt = list(range(300, 316))
    run_to_completion(session, "a", prompt)
    s = admit(session, "b", prompt).scheduled[0]
    assert (s.num_cached_tokens, s.first_position, s.num_scheduled_tokens) == (16, 15, 1)
    assert len(s.new_block_ids) == 4  # all hits, nothing new


def test_eviction_is_lru_and_a_requests_tail_goes_first(daemon):
    client = daemon.client()
    session = client.attach("engine")
    older, newer = list(range(400, 416)), list(range(500, 516))
    run_to_completion(session, "old", older)
    run_to_completion(session, "new", newer)
    # 32 blocks: 8 cached, 24 empty. 25 new blocks evict exactly one cached
    # block: the older request's last block.
    reply = admit(session, "big", list(range(1000, 1100)))
    assert reply.scheduled[0].num_scheduled_tokens == 100
    assert cached_tokens(client, older) == 12
    assert cached_tokens(client, newer) == 16
    assert client.stats().evictions == 1


def test_pinned_blocks_survive_pressure_and_the_pin_cap_is_enforced(daemon):
    client = daemon.client()
    session = client.attach("engine")
    template = list(range(600, 616))
    run_to_completion(session, "t", template)
    pinned = client.stub.Pin(pb.PinRequest(pin_id="tpl", token_ids=template))
    assert (pinned.num_pinned_blocks, pinned.num_pinned_tokens) == (4, 16)
    reply = admit(session, "big", list(range(2000, 2112)))  # the other 28 blocks
    assert reply.scheduled[0].num_scheduled_tokens == 112
    assert cached_tokens(client, template) == 16
    stats = client.stats()
    assert stats.num_free_blocks == 0 and stats.num_pinned_blocks == 4

    session.step(StepInput(frees=["big"]))
    other = list(range(700, 720))
    run_to_completion(session, "o", other)
    try:
        client.stub.Pin(pb.PinRequest(pin_id="second", token_ids=other))  # 4 + 5 > cap of 8
        raise AssertionError("pin over the cap was accepted")
    except grpc.RpcError as err:
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "cap" in err.details()
    assert client.stats().num_pinned_blocks == 4
    assert client.stub.Unpin(pb.UnpinRequest(pin_id="tpl")).num_unpinned_blocks == 4
    assert client.stats().num_pinned_blocks == 0


def test_preemption_frees_the_newest_request(daemon):
    session = daemon.client().attach("engine")
    session.step(
        StepInput(
            admissions=[AdmissionWork("first", list(range(64))), AdmissionWork("second", list(range(100, 164)))],
            token_budget=1000,
        )
    )  # 16 + 16 blocks: the pool is full
    reply = session.step(
        StepInput(
            commits=[CommitWork("first", 64, [1]), CommitWork("second", 64, [2])],
            appends=[AppendWork("first", 1), AppendWork("second", 1)],
            admissions=[AdmissionWork("third", [5])],
            token_budget=10,
        )
    )
    assert list(reply.preempted) == ["second"]
    assert [s.request_id for s in reply.scheduled] == ["first"]
    assert list(reply.waiting) == ["third"]  # a step that preempted admits nobody


def test_a_killed_engines_blocks_are_released(daemon):
    holder = textwrap.dedent(
        """
        import sys, time
        from kvd.client import DaemonClient
        from kvd.step import AdmissionWork, StepInput
        session = DaemonClient.connect(sys.argv[1]).attach("doomed")
        session.step(StepInput(admissions=[AdmissionWork("r", list(range(40)))], token_budget=100))
        print("holding", flush=True)
        time.sleep(600)
        """
    )
    process = subprocess.Popen([sys.executable, "-c", holder, daemon.address], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().strip() == "holding"
        client = daemon.client()
        assert client.stats().num_used_blocks == 10
        process.send_signal(signal.SIGKILL)
        process.wait()
        deadline = time.monotonic() + 10
        while client.stats().num_used_blocks and time.monotonic() < deadline:
            time.sleep(0.1)
        stats = client.stats()
        assert (stats.num_used_blocks, stats.num_sessions, stats.num_requests) == (0, 0, 0)
        assert "lease expired" in daemon.log()
    finally:
        process.kill()


def test_a_lapsed_session_is_gone(daemon):
    client = daemon.client()
    session = client.attach("quiet")
    session._stop.set()  # stop heart-beating, as a hung engine would
    time.sleep(2.5)
    try:
        session.step(StepInput())
        raise AssertionError("a lapsed session still answered")
    except grpc.RpcError as err:
        assert err.code() == grpc.StatusCode.NOT_FOUND and "session" in err.details()


def test_events_report_stored_removed_and_cleared_blocks(daemon):
    client = daemon.client()
    stream = client.events()
    received: list = []
    done = threading.Event()

    def read():
        for batch in stream:
            if batch.snapshot:  # what was cached before: nothing yet
                assert [e.WhichOneof("kind") for e in batch.events] == ["all_cleared"], batch
                continue
            received.extend(batch.events)
            if any(e.HasField("all_cleared") for e in batch.events):
                done.set()
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    time.sleep(0.3)  # let the subscription register
    session = client.attach("engine")
    run_to_completion(session, "a", list(range(800, 808)))
    admit(session, "fill", list(range(900, 1028)))  # all 32 blocks: evicts both of "a"
    session.step(StepInput(frees=["fill"]))
    client.stub.Reset(pb.ResetRequest())
    assert done.wait(10), f"no all_cleared event; got {received}"
    stream.cancel()
    stored = [h for e in received if e.HasField("stored") for h in e.stored.block_hashes]
    removed = [h for e in received if e.HasField("removed") for h in e.removed.block_hashes]
    assert len(stored) == 2 and sorted(removed) == sorted(stored)


def test_a_subscriber_gets_a_snapshot_then_every_later_batch_numbered(daemon):
    client = daemon.client()
    session = client.attach("engine")
    run_to_completion(session, "a", list(range(500, 512)))  # 3 blocks cached before the subscription
    stream = client.events()
    head = next(stream)
    assert head.snapshot and [e.WhichOneof("kind") for e in head.events] == ["all_cleared"]
    describe = client.stub.Describe(pb.DescribeRequest())
    assert head.incarnation == describe.cache_id != ""
    body = next(stream)
    assert body.snapshot and body.sequence == head.sequence and len(body.events[0].stored.block_hashes) == 3
    expected = [h for h in body.events[0].stored.block_hashes]
    run_to_completion(session, "b", list(range(600, 608)))  # 2 more blocks: live batches follow
    live = next(stream)
    assert not live.snapshot and live.sequence == head.sequence + 1 and live.incarnation == head.incarnation
    assert len(live.events[0].stored.block_hashes) == 2
    stream.cancel()
    # A second subscriber's snapshot holds all five, as of the last batch numbered.
    again = client.events()
    parts = [next(again), next(again)]
    again.cancel()
    assert {p.sequence for p in parts} == {live.sequence}
    assert set(parts[1].events[0].stored.block_hashes) == set(expected) | set(live.events[0].stored.block_hashes)


def test_reset_is_refused_while_blocks_are_in_use(daemon):
    client = daemon.client()
    session = client.attach("engine")
    admit(session, "a", list(range(8)))
    try:
        client.stub.Reset(pb.ResetRequest())
        raise AssertionError("reset with blocks in use was accepted")
    except grpc.RpcError as err:
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "in use" in err.details()


def test_metrics_health_and_reflection(daemon):
    client = daemon.client()
    session = client.attach("engine")
    run_to_completion(session, "a", list(range(8)))
    admit(session, "b", list(range(8)) + [1])
    text = urllib.request.urlopen(f"http://127.0.0.1:{daemon.metrics_port}/metrics", timeout=5).read().decode()
    assert 'kvd_blocks{state="total"} 32.0' in text
    assert "kvd_prefix_cache_hit_tokens_total 8.0" in text
    assert "kvd_step_seconds_count" in text

    with grpc.insecure_channel(daemon.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        reply = health.Check(health_pb2.HealthCheckRequest(service="kvd.daemon.v1.KVDaemon"))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        answers = reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = {s.name for s in next(answers).list_services_response.service}
        assert "kvd.daemon.v1.KVDaemon" in names
