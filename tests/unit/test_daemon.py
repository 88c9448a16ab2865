"""The daemon in-process: its lease reaper (driven by a test clock), the quarantine of
lapsed sessions, and its cache's lifetime."""

from __future__ import annotations

import dataclasses
import subprocess
import threading
import time

import pytest

from kvd.common.layout import CacheLayout
from kvd.common.process_identity import Liveness, ProcessIdentity, liveness
from kvd.config import DaemonConfig
from kvd.daemon import Daemon
from kvd.errors import NotFoundError, PreconditionError
from kvd_api.daemon.v1 import daemon_pb2 as pb

LAYOUT = CacheLayout(num_layers=1, num_kv_heads=1, head_dim=4, block_size=4, dtype="float32")


def arrive(request_id: str, tokens: list[int]) -> pb.StepRequest:
    return pb.StepRequest(new_requests=[pb.NewRequest(request_id=request_id, prompt_token_ids=tokens)])


class ManualClock:
    """Monotonic seconds that move only when the test says: the daemon reads its
    leases, their renewals and its quarantines on it."""

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


def test_a_lapsed_lease_quarantines_the_sessions_blocks_then_releases_them(daemon, clock):
    session = daemon.attach("engine", LAYOUT).session  # names no process: it cannot be seen
    daemon.step(session.session_id, arrive("r", list(range(9))))
    assert daemon.stats().num_free_blocks < 8
    clock.advance(4.9)
    assert daemon.reap_expired() == []
    daemon.heartbeat(session.session_id)  # renews at the test clock's time
    clock.advance(4.9)
    assert daemon.reap_expired() == []
    clock.advance(0.2)
    assert daemon.reap_expired() == [session.session_id]
    # The engine may be stopped inside a forward: its blocks stay out of reuse.
    stats = daemon.stats()
    assert (stats.num_sessions, stats.num_quarantined_sessions, stats.num_quarantined_blocks) == (0, 1, 3)
    assert stats.num_free_blocks == 5
    with pytest.raises(NotFoundError):
        daemon.heartbeat(session.session_id)
    clock.advance(daemon.config.quarantine_s - 0.1)
    daemon.reap_expired()
    assert daemon.stats().num_quarantined_sessions == 1
    clock.advance(0.1)  # its process cannot be seen: held quarantine_s, then released
    daemon.reap_expired()
    assert daemon.stats().num_free_blocks == 8 and daemon.stats().num_quarantined_sessions == 0


def _lapse(daemon: Daemon, clock: ManualClock, process: ProcessIdentity | None) -> str:
    session = daemon.attach("engine", LAYOUT, process).session
    daemon.step(session.session_id, arrive("r", list(range(9))))
    clock.advance(daemon.config.lease_s + 0.1)
    assert daemon.reap_expired() == [session.session_id]
    return session.session_id


def test_a_quarantine_ends_when_the_engine_detaches(daemon, clock):
    session_id = _lapse(daemon, clock, ProcessIdentity.of_this_process())
    assert daemon.stats().num_quarantined_sessions == 1
    assert daemon.detach(session_id) == 1  # its loop left the forward: it cannot write
    assert daemon.stats().num_free_blocks == 8 and daemon.stats().num_quarantined_sessions == 0
    with pytest.raises(NotFoundError):
        daemon.detach(session_id)


def test_a_quarantine_lasts_while_the_engines_process_lives_and_ends_when_it_is_gone(daemon, clock):
    engine = subprocess.Popen(["sleep", "60"])
    try:
        _lapse(daemon, clock, ProcessIdentity.of_pid(engine.pid))
        clock.advance(10 * daemon.config.quarantine_s)  # alive: no time bound
        daemon.reap_expired()
        assert daemon.stats().num_quarantined_sessions == 1 and daemon.stats().num_free_blocks == 5
    finally:
        engine.kill()
        engine.wait()
    daemon.reap_expired()
    assert daemon.stats().num_quarantined_sessions == 0 and daemon.stats().num_free_blocks == 8


def test_a_lapsed_session_whose_process_is_gone_is_released_at_once(daemon, clock):
    gone = subprocess.Popen(["true"])
    identity = ProcessIdentity.of_pid(gone.pid)
    gone.wait()
    _lapse(daemon, clock, identity)
    assert daemon.stats().num_quarantined_sessions == 0 and daemon.stats().num_free_blocks == 8


def test_a_process_is_told_apart_from_its_pid_reused_or_another_namespace():
    me = ProcessIdentity.of_this_process()
    assert liveness(me) is Liveness.ALIVE
    assert liveness(dataclasses.replace(me, start_ticks=me.start_ticks + 1)) is Liveness.GONE  # pid reused
    assert liveness(dataclasses.replace(me, pid_namespace="pid:[1]")) is Liveness.UNKNOWN  # another container
    assert liveness(dataclasses.replace(me, boot_id="another-host")) is Liveness.UNKNOWN
    assert liveness(None) is Liveness.UNKNOWN


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
        daemon.cached_prefix([1, 2, 3, 4], b"", [])
    with pytest.raises(PreconditionError, match="attach with the model's layout"):
        daemon.attach("engine", None)
    assert daemon.stats().num_blocks == 0


def test_the_cache_is_made_whole_at_the_first_attach_and_kept(daemon):
    memory = daemon.attach("a", LAYOUT).memory
    cache_id = daemon.cache_id
    assert daemon.cache_memory() is memory and memory.layout.block_size == 4 and len(cache_id) == 32
    again = daemon.attach("b", None).memory
    assert again is memory and daemon.cache_id == cache_id
    other = CacheLayout(num_layers=2, num_kv_heads=1, head_dim=4, block_size=4, dtype="float32")
    with pytest.raises(PreconditionError, match="does not match"):
        daemon.attach("c", other)


def test_events_reach_every_subscriber_and_close_ends_their_streams(tmp_path, clock):
    daemon = Daemon(DaemonConfig(block_size=4, num_blocks=8, shm_dir=str(tmp_path), model_layout=LAYOUT), clock=clock)
    (first, snapshot), (second, _) = daemon.subscribe(), daemon.subscribe()
    assert (snapshot.incarnation, snapshot.sequence, snapshot.device) == (daemon.cache_id, 0, [])
    session = daemon.attach("engine", None).session
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
