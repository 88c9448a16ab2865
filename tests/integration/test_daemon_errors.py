"""Bad input gets a clear status and message, and changes nothing."""

from __future__ import annotations

import grpc
import pytest

from kvd.step import AdmissionWork, AppendWork, CommitWork, StepInput
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
    session.step(StepInput(admissions=[AdmissionWork("r", list(range(12)))], token_budget=64))
    session.step(StepInput(commits=[CommitWork("r", 12)]))
    session.step(StepInput(admissions=[AdmissionWork("gone", [1, 2])], token_budget=64))
    session.step(StepInput(frees=["gone"]))
    yield client, session
    daemon.stop()
    shutil.rmtree(folder, ignore_errors=True)


def snapshot(client):
    s = client.stats()
    return (s.num_free_blocks, s.num_cached_blocks, s.num_requests, s.num_pinned_blocks, s.evictions, s.hit_tokens)


GOOD_ADMISSION = AdmissionWork("new", [7, 7, 7, 7, 7])
INVALID = grpc.StatusCode.INVALID_ARGUMENT

BAD_STEPS = {
    "unknown request in frees": (StepInput(frees=["nope"]), grpc.StatusCode.NOT_FOUND, "unknown request 'nope'"),
    "unknown request in appends": (
        StepInput(appends=[AppendWork("nope", 1)], token_budget=4),
        grpc.StatusCode.NOT_FOUND,
        "unknown request",
    ),
    "double free in one step": (
        StepInput(frees=["r", "r"], admissions=[GOOD_ADMISSION], token_budget=8),
        INVALID,
        "twice",
    ),
    "free of a freed request": (StepInput(frees=["gone"]), INVALID, "already freed"),
    "zero tokens appended": (
        StepInput(appends=[AppendWork("r", 0)], token_budget=4),
        INVALID,
        "num_tokens must be >= 1",
    ),
    "negative token budget": (StepInput(admissions=[GOOD_ADMISSION], token_budget=-3), INVALID, "token_budget"),
    "empty prompt": (StepInput(admissions=[AdmissionWork("e", [])], token_budget=4), INVALID, "empty"),
    "negative token id, after a good admission": (
        StepInput(admissions=[GOOD_ADMISSION, AdmissionWork("neg", [1, -4])], token_budget=64),
        INVALID,
        "token ids must be integers",
    ),
    "token id beyond 32 bits": (
        StepInput(admissions=[AdmissionWork("big", [2**40])], token_budget=4),
        INVALID,
        "token ids must be integers",
    ),
    "sampled token id out of range": (
        StepInput(commits=[CommitWork("r", 12, [-1])]),
        INVALID,
        "token ids must be integers",
    ),
    "commit beyond the scheduled slots": (
        StepInput(commits=[CommitWork("r", 13, [5])]),
        INVALID,
        "exceeds",
    ),
    "commit going backwards": (StepInput(commits=[CommitWork("r", 4)]), INVALID, "goes back"),
    "admitting a running request again": (
        StepInput(admissions=[AdmissionWork("r", [1])], token_budget=4),
        INVALID,
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


def test_misaligned_columns_are_refused(served):
    client, session = served
    before = snapshot(client)
    bad_commits = pb.StepRequest(session_id=session.session_id)
    bad_commits.commits.request_ids.extend(["r", "r2"])
    bad_commits.commits.num_computed_tokens.append(12)
    bad_commits.commits.num_new_tokens.extend([0, 0])
    bad_tokens = pb.StepRequest(session_id=session.session_id)
    bad_tokens.commits.request_ids.append("r")
    bad_tokens.commits.num_computed_tokens.append(12)
    bad_tokens.commits.num_new_tokens.append(2)
    bad_tokens.commits.new_token_ids.append(5)
    bad_appends = pb.StepRequest(session_id=session.session_id, token_budget=4)
    bad_appends.appends.request_ids.append("r")
    for request, words in ((bad_commits, "same length"), (bad_tokens, "add up"), (bad_appends, "same length")):
        with pytest.raises(grpc.RpcError) as err:
            client.stub.Step(request)
        assert err.value.code() == INVALID and words in err.value.details()
    assert snapshot(client) == before


def test_unknown_session(served):
    client, _ = served
    for call in (
        lambda: client.stub.Step(pb.StepRequest(session_id="no-such-session")),  # an empty step
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
