"""The daemon's KV memory: shared with other processes, byte for byte."""

from __future__ import annotations

import hashlib
import os
import stat
import subprocess
import sys
import textwrap

import grpc
import pytest
import torch

from kvd.common import wire
from kvd.common.layout import CacheLayout
from kvd_api.daemon.v1 import daemon_pb2 as pb

WRITER = textwrap.dedent(
    """
    import sys, torch
    from kvd.common.client import DaemonClient
    client = DaemonClient.connect(sys.argv[1])
    session = client.attach("writer")
    block = int(sys.argv[2])
    pattern = torch.arange(session.cache[block].numel(), dtype=session.cache.dtype) + 0.5
    session.cache[block].copy_(pattern.view_as(session.cache[block]))
    session.detach()
    """
)


def block_digest(tensor: torch.Tensor) -> bytes:
    return hashlib.sha256(tensor.contiguous().view(torch.uint8).numpy().tobytes()).digest()


def test_a_block_written_by_another_process_is_seen_by_the_daemon_and_by_us(daemon):
    client = daemon.client()
    ours = client.attach("reader")
    assert ours.cache is not None and ours.cache.shape == (32, 2, 2, 4, 2, 4)
    before = client.stub.InspectBlock(pb.InspectBlockRequest(block_id=5)).data_sha256

    subprocess.run([sys.executable, "-c", WRITER, daemon.address, "5"], check=True, timeout=60)

    expected = (torch.arange(ours.cache[5].numel(), dtype=torch.float32) + 0.5).view_as(ours.cache[5])
    assert torch.equal(ours.cache[5], expected), "our mapping does not see the other process's write"
    seen_by_daemon = client.stub.InspectBlock(pb.InspectBlockRequest(block_id=5)).data_sha256
    assert seen_by_daemon == block_digest(expected) != before
    # Neighbouring blocks are untouched: one block is one contiguous region.
    assert torch.count_nonzero(ours.cache[4]) == 0 and torch.count_nonzero(ours.cache[6]) == 0


def test_per_layer_views_are_strided_slices_of_the_block(daemon):
    session = daemon.client().attach("views")
    cache = session.cache
    layer1_keys = cache[:, 1, 0]  # [blocks, block_size, kv_heads, head_dim]
    layer1_keys[7].fill_(3.0)
    assert torch.all(cache[7, 1, 0] == 3.0) and torch.count_nonzero(cache[7, 0]) == 0
    assert torch.count_nonzero(cache[7, 1, 1]) == 0


def test_socket_is_private_and_shared_file_is_removed_at_shutdown(daemon):
    assert stat.S_IMODE(os.stat(daemon.socket_path).st_mode) == 0o600
    files = os.listdir(daemon.shm_dir)
    assert len(files) == 1 and files[0].endswith(".kv")
    assert daemon.stop() == 0
    assert os.listdir(daemon.shm_dir) == []


def test_cache_is_created_by_the_first_engine_and_later_layouts_must_match(daemon_factory):
    daemon = daemon_factory("--block-size", "4", "--num-blocks", "8")
    client = daemon.client()
    assert not client.stub.Describe(pb.DescribeRequest()).ready
    with pytest.raises(grpc.RpcError) as no_layout:
        client.attach("no-layout")
    assert no_layout.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "layout" in no_layout.value.details()

    model = CacheLayout(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype="float64")
    first = client.attach("engine-1", model)
    assert first.layout == model and first.num_blocks == 8 and first.cache.dtype == torch.float64
    described = client.stub.Describe(pb.DescribeRequest())
    assert described.ready and described.layout.num_layers == 3

    other = CacheLayout(num_layers=4, num_kv_heads=2, head_dim=8, block_size=4, dtype="float64")
    with pytest.raises(grpc.RpcError) as mismatch:
        client.attach("engine-2", other)
    assert mismatch.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "layers=4" in mismatch.value.details() and "layers=3" in mismatch.value.details()


def test_a_layout_that_does_not_fit_the_budget_is_refused(daemon_factory, workdir):
    daemon = daemon_factory("--block-size", "16", "--memory-budget", "64KiB")
    huge = CacheLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype="float32")
    with pytest.raises(grpc.RpcError) as err:
        daemon.client().attach("too-big", huge)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "memory budget" in err.value.details()
    assert not daemon.client().stub.Describe(pb.DescribeRequest()).ready

    # The same layout given on the command line: the daemon says why and exits.
    result = subprocess.run(
        [sys.executable, "-m", "kvd.cli", "--socket", os.path.join(workdir, "x.sock"), "--metrics-port", "0"]
        + ["--num-layers", "32", "--num-kv-heads", "8", "--head-dim", "128", "--memory-budget", "64KiB"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "does not fit one block" in result.stderr


def test_a_block_size_other_than_the_daemons_is_refused(daemon):
    layout = wire.layout_to_pb(CacheLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_size=8, dtype="float32"))
    with pytest.raises(grpc.RpcError) as err:
        daemon.client().stub.Attach(pb.AttachRequest(client_name="bs", protocol_version=2, layout=layout))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "block_size 8" in err.value.details()
