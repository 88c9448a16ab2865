"""Step semantics through the daemon's gRPC API (4-token blocks, 32 blocks)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvd_api.daemon.v1 import daemon_pb2 as pb
from tests.conftest import wait_for


def admit(session, request_id, tokens, budget=1000, salt=b"", max_new_tokens=1):
    new = pb.NewRequest(request_id=request_id, prompt_token_ids=tokens, cache_salt=salt, max_new_tokens=max_new_tokens)
    settings = pb.SessionSettings(max_num_seqs=64, token_budget=budget)
    return session.step(pb.StepRequest(new_requests=[new], settings=settings))


def commit(request_id, num_computed, sampled=()) -> pb.Commits:
    return pb.Commits(
        request_ids=[request_id],
        num_computed_tokens=[num_computed],
        num_new_tokens=[len(sampled)],
        new_token_ids=sampled,
    )


def first_row(reply) -> tuple[int, int, int, int]:
    """(first position, tokens, cached tokens, new blocks) of the first scheduled request."""
    s = reply.scheduled
    return s.first_positions[0], s.num_tokens[0], s.num_cached_tokens[0], s.num_new_blocks[0]


def run_to_completion(session, request_id, tokens, salt=b""):
    """Admits, computes the whole prompt, commits and finishes: the blocks are cached."""
    reply = admit(session, request_id, tokens, salt=salt)
    first, num_tokens, cached, _ = first_row(reply)
    assert first + num_tokens == len(tokens)
    released = session.step(pb.StepRequest(commits=commit(request_id, len(tokens)), finished=[request_id]))
    assert list(released.released) == [request_id]
    return cached


def cached_tokens(client, tokens, salt=b""):
    return client.stub.Lookup(pb.LookupRequest(token_ids=tokens, cache_salt=salt)).num_cached_tokens


def test_a_shared_prefix_is_served_from_the_cache(daemon):
    client = daemon.client()
    session = client.attach("engine")
    prefix = list(range(100, 112))  # 3 full blocks
    assert run_to_completion(session, "a", prefix + [1, 2, 3, 4, 5]) == 0
    assert first_row(admit(session, "b", prefix + [9, 9, 9]))[:3] == (12, 3, 12)
    assert client.stats().hit_tokens == 12
    # Another tenant's salt never hits.
    assert first_row(admit(session, "c", prefix + [9], salt=b"tenant-b"))[2] == 0


def test_the_budget_counts_only_uncached_tokens_and_chunks_the_rest(daemon):
    session = daemon.client().attach("engine")
    prefix = list(range(200, 216))  # 4 blocks
    run_to_completion(session, "a", prefix + [1])
    reply = admit(session, "b", prefix + list(range(10)), budget=6)
    assert first_row(reply) == (16, 6, 16, 4 + 2)  # the hits, then blocks for 6 new tokens only
    nxt = session.step(pb.StepRequest(commits=commit("b", 22)))
    assert first_row(nxt) == (22, 4, 0, 1)


def test_a_fully_cached_prompt_computes_only_its_last_token(daemon):
    session = daemon.client().attach("engine")
    prompt = list(range(300, 316))
    run_to_completion(session, "a", prompt)
    assert first_row(admit(session, "b", prompt)) == (15, 1, 16, 4)  # all hits, nothing new


def test_eviction_is_lru_and_a_requests_tail_goes_first(daemon):
    client = daemon.client()
    session = client.attach("engine")
    older, newer = list(range(400, 416)), list(range(500, 516))
    run_to_completion(session, "old", older)
    run_to_completion(session, "new", newer)
    # 32 blocks: 8 cached, 24 empty. 25 new blocks evict exactly one cached
    # block: the older request's last block.
    reply = admit(session, "big", list(range(1000, 1100)))
    assert first_row(reply)[1] == 100
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
    assert first_row(reply)[1] == 112
    assert cached_tokens(client, template) == 16
    stats = client.stats()
    assert stats.num_free_blocks == 0 and stats.num_pinned_blocks == 4

    session.step(pb.StepRequest(finished=["big"]))
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


def test_preemption_frees_the_newest_request_which_waits_again(daemon):
    session = daemon.client().attach("engine")
    new = [
        pb.NewRequest(request_id="first", prompt_token_ids=list(range(64)), max_new_tokens=8),
        pb.NewRequest(request_id="second", prompt_token_ids=list(range(100, 164)), max_new_tokens=8),
    ]
    session.step(pb.StepRequest(new_requests=new))  # 16 + 16 blocks: the pool is full
    commits = pb.Commits(
        request_ids=["first", "second"], num_computed_tokens=[64, 64], num_new_tokens=[1, 1], new_token_ids=[1, 2]
    )
    third = pb.NewRequest(request_id="third", prompt_token_ids=[5], max_new_tokens=8)
    reply = session.step(pb.StepRequest(commits=commits, new_requests=[third]))
    assert list(reply.preempted) == ["second"]
    assert list(reply.scheduled.request_ids) == ["first"]
    assert reply.num_waiting == 2  # a step that preempted admits nobody
    reply = session.step(pb.StepRequest(finished=["first", "third"]))
    assert list(reply.released) == ["first", "third"]
    # "second" resumes from the cache: all its committed blocks but the last,
    # which "first"'s new block evicted (a freed request's tail goes first).
    assert list(reply.scheduled.request_ids) == ["second"] and reply.scheduled.num_cached_tokens[0] == 60


def test_a_killed_engines_blocks_are_released(daemon):
    holder = textwrap.dedent(
        """
        import sys, time
        from kvd.common.client import DaemonClient
        from kvd_api.daemon.v1 import daemon_pb2 as pb
        session = DaemonClient.connect(sys.argv[1]).attach("doomed")
        session.step(pb.StepRequest(new_requests=[pb.NewRequest(request_id="r", prompt_token_ids=range(40))]))
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
        assert wait_for(lambda: client.stats().num_used_blocks == 0, 60)
        stats = client.stats()
        assert (stats.num_used_blocks, stats.num_sessions, stats.num_requests) == (0, 0, 0)
        assert "lease expired" in daemon.log()
    finally:
        process.kill()


def test_a_lapsed_session_is_gone(daemon):
    client = daemon.client()
    session = client.attach("quiet")
    session._stop.set()  # stop heart-beating, as a hung engine would
    assert wait_for(lambda: client.stats().num_sessions == 0, 60), "the lease never lapsed"
    try:
        session.step(pb.StepRequest())
        raise AssertionError("a lapsed session still answered")
    except grpc.RpcError as err:
        assert err.code() == grpc.StatusCode.NOT_FOUND and "session" in err.details()


def test_events_report_stored_removed_and_cleared_blocks(daemon):
    client = daemon.client()
    stream = client.events()
    received: list = []
    subscribed, done = threading.Event(), threading.Event()

    def read():
        for batch in stream:
            if batch.snapshot:  # what was cached before: nothing yet
                assert [e.WhichOneof("kind") for e in batch.events] == ["all_cleared"], batch
                subscribed.set()
                continue
            received.extend(batch.events)
            if any(e.HasField("all_cleared") for e in batch.events):
                done.set()
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert subscribed.wait(60)  # the snapshot came: every later change is streamed
    session = client.attach("engine")
    run_to_completion(session, "a", list(range(800, 808)))
    admit(session, "fill", list(range(900, 1028)))  # all 32 blocks: evicts both of "a"
    session.step(pb.StepRequest(finished=["fill"]))
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
