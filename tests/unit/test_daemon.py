"""The daemon in-process: its lease reaper (driven by a test clock) and its cache's lifetime."""

from __future__ import annotations

import threading
import time

import pytest

from kvd.config import DaemonConfig
from kvd.daemon import Daemon
from kvd.errors import NotFoundError, PreconditionError
from kvd.layout import CacheLayout
from kvd_api.daemon.v1 import daemon_pb2 as pb

LAYOUT = CacheLayout(num_layers=1, num_kv_heads=1, head_dim=4, block_size=4, dtype="float32")


def arrive(request_id: str, tokens: list[int]) -> pb.StepRequest:
    return pb.StepRequest(new_requests=[pb.NewRequest(request_id=request_id, prompt_token_ids=tokens)])


class ManualClock:
    """Monotonic seconds that move only when the test says (offset from the real
    clock, so the Step path's own renewals stay comparable)."""

    def __init__(self) -> None:
        self.now = time.monotonic()

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock():
    return ManualClock()


@pytest.fixture
def daemon(tmp_path, clock):
    d = Daemon(DaemonConfig(block_size=4, num_blocks=8, shm_dir=str(tmp_path), lease_s=5.0), clock=clock)
    yield d
    d.close()


def test_a_lapsed_lease_releases_the_sessions_blocks(daemon, clock):
    session, _ = daemon.attach("engine", LAYOUT)
    daemon.step(session.session_id, arrive("r", list(range(9))))
    assert daemon.stats().num_free_blocks < 8
    clock.advance(4.9)
    assert daemon.reap_expired() == []
    daemon.heartbeat(session.session_id)  # renews at the test clock's time
    clock.advance(4.9)
    assert daemon.reap_expired() == []
    clock.advance(0.2)
    assert daemon.reap_expired() == [session.session_id]
    assert daemon.stats().num_free_blocks == 8 and daemon.stats().num_sessions == 0
    with pytest.raises(NotFoundError):
        daemon.heartbeat(session.session_id)


def test_the_started_reaper_expires_sessions_of_an_embedded_daemon(tmp_path, clock):
    daemon = Daemon(DaemonConfig(block_size=4, num_blocks=8, shm_dir=str(tmp_path), lease_s=0.04), clock=clock)
    daemon.attach("engine", LAYOUT)
    daemon.start()
    try:
        clock.advance(1.0)
        # The reaper passes every lease_s/4 = 10 ms: the session goes at its next pass.
        deadline = time.monotonic() + 10
        while daemon.stats().num_sessions and time.monotonic() < deadline:
            threading.Event().wait(0.005)
        assert daemon.stats().num_sessions == 0
    finally:
        daemon.close()  # stops the reaper too


def test_without_a_cache_the_daemon_refuses_cache_work_by_name(daemon):
    assert daemon.cache_memory() is None and daemon.cache_id == ""
    with pytest.raises(PreconditionError, match="no cache yet"):
        daemon.lookup([1, 2, 3, 4], b"", [])
    with pytest.raises(PreconditionError, match="attach with the model's layout"):
        daemon.attach("engine", None)
    assert daemon.stats().num_blocks == 0


def test_the_cache_is_made_whole_at_the_first_attach_and_kept(daemon):
    _, memory = daemon.attach("a", LAYOUT)
    cache_id = daemon.cache_id
    assert daemon.cache_memory() is memory and memory.layout.block_size == 4 and len(cache_id) == 32
    _, again = daemon.attach("b", None)
    assert again is memory and daemon.cache_id == cache_id
    other = CacheLayout(num_layers=2, num_kv_heads=1, head_dim=4, block_size=4, dtype="float32")
    with pytest.raises(PreconditionError, match="does not match"):
        daemon.attach("c", other)


def test_events_reach_every_subscriber_and_close_ends_their_streams(tmp_path, clock):
    daemon = Daemon(DaemonConfig(block_size=4, num_blocks=8, shm_dir=str(tmp_path), model_layout=LAYOUT), clock=clock)
    (first, snapshot), (second, _) = daemon.subscribe(), daemon.subscribe()
    assert (snapshot.incarnation, snapshot.sequence, snapshot.device) == (daemon.cache_id, 0, [])
    session, _ = daemon.attach("engine", None)
    daemon.step(session.session_id, arrive("r", list(range(9))))
    done = pb.Commits(request_ids=["r"], num_computed_tokens=[9], num_new_tokens=[0])
    daemon.step(session.session_id, pb.StepRequest(commits=done, finished=["r"]))
    assert first.get_nowait() == second.get_nowait() and first.empty() is second.empty()
    daemon.unsubscribe(second)
    _, later = daemon.subscribe()
    assert len(later.device) == 2 and later.sequence >= 1
    daemon.close()
    sequences = []
    while (batch := first.get_nowait()) is not None:
        assert batch.events and batch.incarnation == daemon.cache_id
        sequences.append(batch.sequence)
    assert sequences == list(range(1, len(sequences) + 1))
    assert second.empty()
