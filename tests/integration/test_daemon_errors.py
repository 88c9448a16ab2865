"""Bad input gets a clear status and message, and changes nothing."""

from __future__ import annotations

import grpc
import pytest

from kvd_api.daemon.v1 import daemon_pb2 as pb


@pytest.fixture(scope="module")
def served():
    """One daemon for the whole module, with one running request "r" (12 tokens)."""
    import shutil
    import tempfile

    from tests.conftest import SMALL_LAYOUT, start_daemon

    folder = tempfile.mkdtemp(prefix="kvd-", dir="/tmp")
    daemon = start_daemon([*SMALL_LAYOUT, "--num-blocks", "32", "--max-pinned-fraction", "0.25"], folder)
    client = daemon.client()
    session = client.attach("engine")
    session.step(pb.StepRequest(admissions=[pb.Admission(request_id="r", token_ids=list(range(12)))], token_budget=64))
    session.step(pb.StepRequest(commits=[pb.Commit(request_id="r", num_computed_tokens=12)]))
    session.step(pb.StepRequest(admissions=[pb.Admission(request_id="gone", token_ids=[1, 2])], token_budget=64))
    session.step(pb.StepRequest(frees=["gone"]))
    yield client, session
    daemon.stop()
    shutil.rmtree(folder, ignore_errors=True)


def snapshot(client):
    s = client.stats()
    return (s.num_free_blocks, s.num_cached_blocks, s.num_requests, s.num_pinned_blocks, s.evictions, s.hit_tokens)


GOOD_ADMISSION = pb.Admission(request_id="new", token_ids=[7, 7, 7, 7, 7])

BAD_STEPS = {
    "unknown request in frees": (pb.StepRequest(frees=["nope"]), grpc.StatusCode.NOT_FOUND, "unknown request 'nope'"),
    "unknown request in appends": (
        pb.StepRequest(appends=[pb.Append(request_id="nope", num_tokens=1)], token_budget=4),
        grpc.StatusCode.NOT_FOUND,
        "unknown request",
    ),
    "double free in one step": (
        pb.StepRequest(frees=["r", "r"], admissions=[GOOD_ADMISSION], token_budget=8),
        grpc.StatusCode.INVALID_ARGUMENT,
        "twice",
    ),
    "free of a freed request": (
        pb.StepRequest(frees=["gone"]),
        grpc.StatusCode.INVALID_ARGUMENT,
        "already freed",
    ),
    "zero tokens appended": (
        pb.StepRequest(appends=[pb.Append(request_id="r", num_tokens=0)], token_budget=4),
        grpc.StatusCode.INVALID_ARGUMENT,
        "num_tokens must be >= 1",
    ),
    "negative token budget": (
        pb.StepRequest(admissions=[GOOD_ADMISSION], token_budget=-3),
        grpc.StatusCode.INVALID_ARGUMENT,
        "token_budget",
    ),
    "empty prompt": (
        pb.StepRequest(admissions=[pb.Admission(request_id="e")], token_budget=4),
        grpc.StatusCode.INVALID_ARGUMENT,
        "empty",
    ),
    "negative token id, after a good admission": (
        pb.StepRequest(admissions=[GOOD_ADMISSION, pb.Admission(request_id="neg", token_ids=[1, -4])], token_budget=64),
        grpc.StatusCode.INVALID_ARGUMENT,
        "token ids must be integers",
    ),
    "token id beyond 32 bits": (
        pb.StepRequest(admissions=[pb.Admission(request_id="big", token_ids=[2**40])], token_budget=4),
        grpc.StatusCode.INVALID_ARGUMENT,
        "token ids must be integers",
    ),
    "commit beyond the scheduled slots": (
        pb.StepRequest(commits=[pb.Commit(request_id="r", num_computed_tokens=13, new_token_ids=[5])]),
        grpc.StatusCode.INVALID_ARGUMENT,
        "exceeds",
    ),
    "commit going backwards": (
        pb.StepRequest(commits=[pb.Commit(request_id="r", num_computed_tokens=4)]),
        grpc.StatusCode.INVALID_ARGUMENT,
        "goes back",
    ),
    "admitting a running request again": (
        pb.StepRequest(admissions=[pb.Admission(request_id="r", token_ids=[1])], token_budget=4),
        grpc.StatusCode.INVALID_ARGUMENT,
        "already running",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_STEPS))
def test_a_bad_step_is_refused_whole(served, case):
    client, session = served
    request, code, words = BAD_STEPS[case]
    before = snapshot(client)
    with pytest.raises(grpc.RpcError) as err:
        session.step(request)
    assert err.value.code() == code
    assert words in err.value.details()
    assert snapshot(client) == before


def test_unknown_session(served):
    client, _ = served
    for call in (
        lambda: client.stub.Step(pb.StepRequest(session_id="no-such-session")),
        lambda: client.stub.Heartbeat(pb.HeartbeatRequest(session_id="no-such-session")),
        lambda: client.stub.Detach(pb.DetachRequest(session_id="no-such-session")),
    ):
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == grpc.StatusCode.NOT_FOUND and "no-such-session" in err.value.details()


def test_bad_pins_and_lookups(served):
    client, _ = served
    before = snapshot(client)
    cases = [
        (lambda: client.stub.Pin(pb.PinRequest(pin_id="", token_ids=[1])), grpc.StatusCode.INVALID_ARGUMENT),
        (lambda: client.stub.Pin(pb.PinRequest(pin_id="x")), grpc.StatusCode.INVALID_ARGUMENT),
        (lambda: client.stub.Unpin(pb.UnpinRequest(pin_id="never")), grpc.StatusCode.NOT_FOUND),
        (lambda: client.stub.Lookup(pb.LookupRequest(token_ids=[-1])), grpc.StatusCode.INVALID_ARGUMENT),
        (lambda: client.stub.InspectBlock(pb.InspectBlockRequest(block_id=99)), grpc.StatusCode.INVALID_ARGUMENT),
    ]
    for call, code in cases:
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == code, err.value.details()
    assert snapshot(client) == before


def test_attach_with_a_nonsense_layout(served):
    client, _ = served
    layout = pb.CacheLayout(num_layers=0, num_kv_heads=2, head_dim=4, dtype=pb.DTYPE_FLOAT32)
    with pytest.raises(grpc.RpcError) as err:
        client.stub.Attach(pb.AttachRequest(client_name="x", layout=layout))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "num_layers" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        client.stub.Attach(pb.AttachRequest(client_name="x", layout=pb.CacheLayout(num_layers=2)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "dtype" in err.value.details()
