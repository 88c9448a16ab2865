"""CUDA: a host-tier copy into blocks a pipelined forward may still write
waits for that forward (its interprocess event, sent in the Step).

This process plays the engine, Step by Step, against a real daemon on the
GPU with a host tier:

    A's 3 full blocks are computed, copied to the host tier, then evicted
    from the device (another request takes every block);
    C is admitted (3 blocks) and "forward N" starts on our stream: a long
    sleep, then it writes C's blocks;
    the Step for N+1, sent while forward N runs, cancels C (its blocks are
    fenced: forward N may write them) and brings B, whose prefix is A's: its
    admission takes the fence first, so A's bytes are swapped into C's blocks.

The swap-in must land after forward N's writes. Without the forward's event
(what every Step carried before it existed) the copy runs at once and the
forward overwrites it, which the test shows too, so it can fail.
"""

from __future__ import annotations

import pytest
import torch

from kvd.common.client import DaemonClient
from kvd_api.daemon.v1 import daemon_pb2 as pb
from tests.conftest import wait_for

pytestmark = pytest.mark.gpu

BLOCK = 16
#: About 0.2-0.5 s on current GPUs: the daemon's copy would land long before.
FORWARD_SLEEP_CYCLES = 500_000_000


def new(request_id: str, tokens: list[int], max_new_tokens: int = 1) -> pb.NewRequest:
    return pb.NewRequest(request_id=request_id, prompt_token_ids=tokens, max_new_tokens=max_new_tokens)


def blocks_of(reply: pb.StepResponse, request_id: str) -> list[int]:
    s = reply.scheduled
    index = list(s.request_ids).index(request_id)
    start = sum(s.num_new_blocks[:index])
    return list(s.new_block_ids[start : start + s.num_new_blocks[index]])


def copies_done(client: DaemonClient) -> bool:
    stats = client.stats()
    return stats.num_copying_blocks == 0 and stats.num_host_blocks_read == 0


@pytest.mark.parametrize("send_event", [True, False], ids=["with-forward-event", "without-it"])
def test_a_swap_in_into_fenced_blocks_lands_after_the_forward_in_flight(daemon_factory, send_event):
    daemon = daemon_factory(
        "--device", "cuda", "--num-layers", "2", "--num-kv-heads", "2", "--head-dim", "64",
        "--block-size", str(BLOCK), "--num-blocks", "8", "--host-num-blocks", "64", "--cache-dtype", "float32",
    )  # fmt: skip
    client = daemon.client()
    session = client.attach("copy-fence")
    cache = session.cache
    prefix = list(range(1, 3 * BLOCK + 1))  # A's 3 full blocks, B's prefix

    # A: computed (each block filled with its own value), committed, finished:
    # its full blocks are copied to the host tier.
    reply = session.step(pb.StepRequest(new_requests=[new("A", [*prefix, 999])]))
    a_blocks = blocks_of(reply, "A")
    for i, block in enumerate(a_blocks[:3]):
        cache[block].fill_(100.0 + i)
    torch.cuda.synchronize()
    commit = pb.Commits(request_ids=["A"], num_computed_tokens=[len(prefix) + 1], num_new_tokens=[1], new_token_ids=[5])
    session.step(pb.StepRequest(commits=commit, finished=["A"]))
    assert wait_for(lambda: copies_done(client), 30)
    assert client.stats().num_host_cached_blocks >= 3

    # D takes every device block (evicting A's there), then ends.
    reply = session.step(pb.StepRequest(new_requests=[new("D", list(range(1000, 1000 + 8 * BLOCK)))]))
    assert len(blocks_of(reply, "D")) == 8
    session.step(pb.StepRequest(finished=["D"]))
    assert client.device_cached_tokens([*prefix, 999]) == 0, (
        "A's blocks are still on the device: nothing would be swapped in"
    )

    # C is admitted; forward N (ours) will write its blocks after a long sleep.
    reply = session.step(pb.StepRequest(new_requests=[new("C", list(range(2000, 2000 + 3 * BLOCK)), 16)]))
    c_blocks = blocks_of(reply, "C")[:3]
    stream = torch.cuda.Stream()
    forward_end = torch.cuda.Event(interprocess=True)
    with torch.cuda.stream(stream):
        torch.cuda._sleep(FORWARD_SLEEP_CYCLES)
        for block in c_blocks:
            cache[block].fill_(7.0)
        forward_end.record(stream)

    # The Step for N+1, sent while forward N runs: C cancelled (fenced), B arrives.
    step = pb.StepRequest(new_requests=[new("B", [*prefix, 500, 501, 502])], finished=["C"], forward_in_flight=True)
    if send_event:
        step.forward_event = forward_end.ipc_handle()
    reply = session.step(step)
    b_blocks = blocks_of(reply, "B")
    assert reply.scheduled.num_host_cached_tokens[0] == len(prefix), "B's prefix did not come from the host tier"
    assert b_blocks[:3] == c_blocks, "B's swap-ins did not target C's fenced blocks: nothing raced"

    # What the engine does before forward N+1: wait for the copies; then read.
    for handle in reply.copy_events:
        stream.wait_event(torch.cuda.Event.from_ipc_handle(cache.device, handle))
    stream.synchronize()
    assert wait_for(lambda: copies_done(client), 30)
    got = [cache[block].unique().tolist() for block in b_blocks[:3]]
    if send_event:
        assert got == [[100.0], [101.0], [102.0]], f"the swap-in raced forward N: {got}"
    else:
        assert got == [[7.0]] * 3, f"without the forward's event the copy should have been overwritten: {got}"
    session.detach()
