"""The host tier under churn: outputs stay token-exact, nothing stays held or copying.

A device pool far smaller than the working set (repeated long documents) and
32 concurrent requests per round, so documents are evicted from the device and
come back from the host tier again and again. float64: every output must equal
`model.generate`'s exactly, with the host tier on and off.

The number of rounds grows with ``--offload-churn-s`` (seconds of churn per
stack; the default, 0, runs two rounds: the second is the one served from the
host tier). ``pytest tests/integration/test_offload.py --offload-churn-s 300``
is the several-minute version.
"""

from __future__ import annotations

import concurrent.futures as cf
import random
import signal
import time

import pytest

from kvd.common.client import DaemonClient
from kvd_api.daemon.v1 import daemon_pb2 as pb
from tests.conftest import blocks_held, memo_greedy, wait_for
from tests.integration.engine_client import generate, request, stub

NEW_TOKENS = 4
CONCURRENT = 32
DOCUMENTS = 4
QUESTIONS = 4  # per document: 16 distinct prompts, each twice per round
DOC_TOKENS = 96  # 6 blocks of 16
DEVICE_BLOCKS = 20  # the documents alone need 24
HOST_BLOCKS = 128


@pytest.fixture(scope="module")
def reference(reference_model):
    return memo_greedy(reference_model, NEW_TOKENS)


def workload(seed: int) -> list[list[int]]:
    """Repeated long documents, each with short distinct questions (token ids)."""
    rng = random.Random(seed)
    docs = [[rng.randrange(100, 40000) for _ in range(DOC_TOKENS)] for _ in range(DOCUMENTS)]
    return [
        docs[i % DOCUMENTS] + [rng.randrange(100, 40000) for _ in range(rng.randrange(3, 12))]
        for i in range(DOCUMENTS * QUESTIONS)
    ]


def churn(address: str, prompts: list[list[int]], churn_s: float, seed: int, min_rounds: int = 2) -> list[tuple]:
    """Rounds of CONCURRENT requests at once, at least ``min_rounds``, for ``churn_s`` seconds."""
    client = stub(address)
    rng = random.Random(seed)
    results = []
    started = time.monotonic()
    rounds = 0
    while rounds < min_rounds or time.monotonic() - started < churn_s:
        batch = rng.sample(prompts * -(-CONCURRENT // len(prompts)), CONCURRENT)
        with cf.ThreadPoolExecutor(CONCURRENT) as pool:
            outputs = list(pool.map(lambda ids: generate(client, request(ids, NEW_TOKENS)), batch))
        results += [(ids, tokens, final.usage) for ids, (tokens, _, final) in zip(batch, outputs, strict=True)]
        rounds += 1
    return results


def settled(daemon) -> bool:
    """No block held by a request, none copying, no host slot being read."""
    with DaemonClient.connect(daemon.address) as client:
        s = client.stats()
    return s.num_used_blocks == 0 and s.num_copying_blocks == 0 and s.num_host_blocks_read == 0


# Both are long tests: the device-only variant's preemptions and recomputes
# are what test_engine_generation's chunking-and-preemption test checks, and
# test_disk_tier's churn cycles blocks through the device and host tiers (and
# the disk) the same way, while the swap-ins here are also killed midway below.
@pytest.mark.long
@pytest.mark.parametrize("host_tier", [True, False], ids=["host-tier", "device-only"])
def test_outputs_equal_generate_under_churn(stack_factory, reference, pytestconfig, host_tier):
    churn_s = pytestconfig.getoption("--offload-churn-s")
    daemon_args = ["--num-blocks", str(DEVICE_BLOCKS)]
    if host_tier:
        daemon_args += ["--host-num-blocks", str(HOST_BLOCKS)]
    engine = stack_factory(daemon_args=daemon_args, engine_args=["--dtype", "float64", "--token-budget", "256"])
    results = churn(engine.address, workload(seed=1), churn_s, seed=2)
    for ids, tokens, _ in results:
        assert tokens == reference(ids), f"a {len(ids)}-token prompt diverged"
    assert wait_for(lambda: settled(engine.daemon), timeout_s=20), "blocks stayed held or copying"
    with DaemonClient.connect(engine.daemon.address) as client:
        stats = client.stats()
        layout = client.stub.Describe(pb.DescribeRequest()).layout
    block_bytes = layout.num_layers * 2 * layout.block_size * layout.num_kv_heads * layout.head_dim * 8
    host_tokens = sum(usage.host_cached_prompt_tokens for _, _, usage in results)
    if host_tier:
        assert host_tokens > 0, "the host tier served nothing"
        # Usage counts each request's own host hits; the daemon also counts
        # those of preempted requests re-admitted, so it may count more.
        assert stats.host_hit_tokens >= host_tokens
        assert stats.bytes_from_host == stats.host_hit_tokens // layout.block_size * block_bytes
        assert stats.bytes_to_host > 0 and stats.bytes_to_host % block_bytes == 0
    else:
        assert stats.num_host_blocks == 0 and host_tokens == 0 and stats.host_hit_tokens == 0


def test_killing_the_engine_amid_swap_ins_leaves_nothing_held_or_copying(stack_factory, model_dir, workdir):
    engine = stack_factory(
        daemon_args=["--num-blocks", str(DEVICE_BLOCKS), "--host-num-blocks", str(HOST_BLOCKS)],
        engine_args=["--token-budget", "256"],
    )
    prompts = workload(seed=3)
    churn(engine.address, prompts, 0, seed=4, min_rounds=1)  # fills the host tier; the device holds a fraction
    client = stub(engine.address)
    pool = cf.ThreadPoolExecutor(CONCURRENT)
    futures = [pool.submit(generate, client, request(ids, 64)) for ids in prompts[:CONCURRENT]]
    daemon = engine.daemon
    with DaemonClient.connect(daemon.address) as dc:
        before = dc.stats().host_hit_tokens
        assert wait_for(lambda: dc.stats().host_hit_tokens > before, timeout_s=60), "no swap-in happened"
    engine.stop(signal.SIGKILL)
    for future in futures:
        future.exception()
    pool.shutdown()
    # The lease (2 s) lapses; the session's blocks come back and no copy stays in flight.
    assert wait_for(lambda: settled(daemon), timeout_s=20), "a killed engine left blocks held or copying"
    assert blocks_held(daemon) == 0
