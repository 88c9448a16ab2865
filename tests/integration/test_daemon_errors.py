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
    session.step(pb.StepRequest(new_requests=[new("r", list(range(12)))]))
    session.step(pb.StepRequest(commits=commit("r", 12)))
    session.step(pb.StepRequest(new_requests=[new("gone", [1, 2])]))
    session.step(pb.StepRequest(finished=["gone"]))
    yield client, session
    daemon.stop()
    shutil.rmtree(folder, ignore_errors=True)


def snapshot(client):
    s = client.stats()
    return (s.num_free_blocks, s.num_cached_blocks, s.num_requests, s.num_pinned_blocks, s.evictions, s.hit_tokens)


def new(request_id, tokens, max_new_tokens=4):
    return pb.NewRequest(request_id=request_id, prompt_token_ids=tokens, max_new_tokens=max_new_tokens)


def commit(request_id, num_computed, sampled=()):
    return pb.Commits(
        request_ids=[request_id],
        num_computed_tokens=[num_computed],
        num_new_tokens=[len(sampled)],
        new_token_ids=sampled,
    )


GOOD_NEW = new("new", [7, 7, 7, 7, 7])
INVALID = grpc.StatusCode.INVALID_ARGUMENT

BAD_STEPS = {
    "unknown request finished": (
        pb.StepRequest(finished=["nope"]),
        grpc.StatusCode.NOT_FOUND,
        "unknown request 'nope'",
    ),
    "unknown request committed": (pb.StepRequest(commits=commit("nope", 1)), grpc.StatusCode.NOT_FOUND, "unknown"),
    "finished twice in one step": (pb.StepRequest(finished=["r", "r"], new_requests=[GOOD_NEW]), INVALID, "twice"),
    "finished after its release": (pb.StepRequest(finished=["gone"]), INVALID, "already released"),
    "zero token budget": (
        pb.StepRequest(new_requests=[GOOD_NEW], settings=pb.SessionSettings(max_num_seqs=4, token_budget=0)),
        INVALID,
        "settings.token_budget",
    ),
    "negative max_num_seqs": (
        pb.StepRequest(settings=pb.SessionSettings(max_num_seqs=-1, token_budget=4)),
        INVALID,
        "settings.max_num_seqs",
    ),
    "empty prompt": (pb.StepRequest(new_requests=[new("e", [])]), INVALID, "new_requests[0].prompt_token_ids is empty"),
    "negative token id, after a good request": (
        pb.StepRequest(new_requests=[GOOD_NEW, new("neg", [1, -4])]),
        INVALID,
        "new_requests[1].prompt_token_ids: token ids must be integers",
    ),
    "token id beyond 32 bits": (pb.StepRequest(new_requests=[new("big", [2**40])]), INVALID, "token ids must be"),
    "negative max_new_tokens": (
        pb.StepRequest(new_requests=[new("m", [1], max_new_tokens=-2)]),
        INVALID,
        "new_requests[0].max_new_tokens",
    ),
    "empty request id": (pb.StepRequest(new_requests=[new("", [1])]), INVALID, "new_requests[0].request_id"),
    "sampled token id out of range": (pb.StepRequest(commits=commit("r", 12, [-1])), INVALID, "token ids must be"),
    "commit beyond the scheduled slots": (pb.StepRequest(commits=commit("r", 13, [5])), INVALID, "exceeds"),
    "commit going backwards": (pb.StepRequest(commits=commit("r", 4)), INVALID, "goes back"),
    "a running request sent again": (pb.StepRequest(new_requests=[new("r", [1])]), INVALID, "already exists"),
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
    for request, words in ((bad_commits, "same length"), (bad_tokens, "add up")):
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
        client.stub.Attach(pb.AttachRequest(client_name="x", protocol_version=2, layout=layout))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "num_layers" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        client.stub.Attach(pb.AttachRequest(client_name="x", protocol_version=2, layout=pb.CacheLayout(num_layers=2)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "dtype" in err.value.details()


def test_an_engine_of_another_protocol_version_is_refused_at_attach(served):
    client, _ = served
    for version in (1, 3):
        with pytest.raises(grpc.RpcError) as err:
            client.stub.Attach(pb.AttachRequest(client_name="old-engine", protocol_version=version))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert f"v{version}" in err.value.details() and "v2" in err.value.details()
    reply = client.stub.Attach(pb.AttachRequest(client_name="new-engine", protocol_version=2))
    assert reply.protocol_version == 2 and reply.lease_s > 0
    client.stub.Detach(pb.DetachRequest(session_id=reply.session_id))
