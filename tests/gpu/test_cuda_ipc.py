"""CUDA: the daemon's cache exported through CUDA IPC and mapped by UUID."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import textwrap

import pytest
import torch

from kvd_api.daemon.v1 import daemon_pb2 as pb

pytestmark = pytest.mark.gpu

WRITER = textwrap.dedent(
    """
    import sys, torch
    from kvd.common.client import DaemonClient
    session = DaemonClient.connect(sys.argv[1]).attach("gpu-writer")
    block = int(sys.argv[2])
    assert session.cache.is_cuda, session.cache.device
    pattern = torch.arange(session.cache[block].numel(), device=session.cache.device, dtype=torch.float32)
    session.cache[block].copy_(pattern.view(session.cache[block].shape).to(session.cache.dtype))
    torch.cuda.synchronize()
    session.detach()
    """
)


def test_a_second_process_maps_the_cuda_cache_and_the_daemon_sees_its_write(daemon_factory):
    daemon = daemon_factory(
        "--device", "cuda", "--num-layers", "4", "--num-kv-heads", "2", "--head-dim", "64",
        "--block-size", "16", "--num-blocks", "64", "--cache-dtype", "bfloat16",
    )  # fmt: skip
    client = daemon.client()
    described = client.stub.Describe(pb.DescribeRequest())
    assert described.memory.WhichOneof("kind") == "cuda_ipc"
    assert described.memory.cuda_ipc.device_uuid == str(torch.cuda.get_device_properties(0).uuid)

    subprocess.run([sys.executable, "-c", WRITER, daemon.address, "9"], check=True, timeout=120)

    ours = client.attach("gpu-reader")
    block = ours.cache[9]
    expected = torch.arange(block.numel(), device=block.device, dtype=torch.float32).view(block.shape).to(block.dtype)
    assert torch.equal(block, expected)
    digest = client.stub.InspectBlock(pb.InspectBlockRequest(block_id=9)).data_sha256
    ours_digest = hashlib.sha256(expected.cpu().contiguous().view(torch.uint8).numpy().tobytes()).digest()
    assert digest == ours_digest
    assert torch.count_nonzero(ours.cache[8]) == 0 and torch.count_nonzero(ours.cache[10]) == 0
