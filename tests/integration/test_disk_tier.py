"""The disk tier with real processes and the real model (float64: every output
must equal ``model.generate``'s exactly).

- a daemon SIGKILLed and started again on the same folder serves the same
  prompts' blocks from disk, token-exact; torn and corrupt files are dropped
  and recomputed; a burst of writes cut by SIGKILL leaves no torn block served;
- another tenant's prompts, and a daemon of another layout on the same folder,
  get nothing from those blocks;
- a workload larger than the device and host tiers cycles through the disk,
  token-exact, and leaves nothing held;
- a full disk (a small tmpfs) stops writes with one warning; serving goes on;
- a template pinned through the gateway is re-warmed from disk after a daemon SIGKILL.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import tempfile
import urllib.request
from pathlib import Path

import pytest

from gateway.client import GatewayClient
from kvd import disk_format
from kvd.common.client import DaemonClient
from kvd.common.hashing import BlockHasher, encode_extra_keys, pack_tokens
from kvd_api.daemon.v1 import daemon_pb2 as pb
from tests.conftest import blocks_held, memo_greedy, start_daemon, start_engine, start_gateway, wait_for
from tests.integration.engine_client import generate, request, stub
from tests.integration.gateway_client import completion
from tests.integration.test_offload import churn, settled

NEW_TOKENS = 4
BLOCK = 16
DOC_TOKENS = 128  # 8 blocks
DOCS = 4
TENANT_A, TENANT_B = b"tenant-a", b"tenant-b"


@pytest.fixture(scope="module")
def reference(reference_model):
    return memo_greedy(reference_model, NEW_TOKENS)


def documents(seed: int, count: int, tokens: int = DOC_TOKENS) -> list[list[int]]:
    """Long documents, each with a short question after it (token ids)."""
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(tokens + rng.randrange(3, 9))] for _ in range(count)]


def block_files(folder: Path, ids: list[int], salt: bytes = b"") -> list[Path]:
    """The files of the prompt's full blocks in a fingerprint's ``folder``."""
    hashes = BlockHasher(encode_extra_keys(salt, ()), BLOCK).advance(pack_tokens(ids))
    return [folder / disk_format.file_name(h) for h in hashes]


def stack(folder: str, disk: Path, model_dir, device_blocks: int, host_blocks: int, *extra: str):
    daemon = start_daemon(
        ["--block-size", str(BLOCK), "--lease-s", "2", "--num-blocks", str(device_blocks),
         "--host-num-blocks", str(host_blocks), "--disk-path", str(disk), "--disk-budget", "4GiB", *extra],
        folder,
    )  # fmt: skip
    engine = start_engine(daemon, ["--model", str(model_dir), "--dtype", "float64", "--token-budget", "256"], folder)
    return daemon, engine


def ask(engine, ids: list[int], salt: bytes = b""):
    req = request(ids, NEW_TOKENS)
    req.cache_salt = salt
    tokens, _, final = generate(stub(engine.address), req)
    return tokens, final.usage


def stats(daemon):
    with DaemonClient.connect(daemon.address) as client:
        return client.stats()


@pytest.fixture(scope="module")
def first_life(model_dir, reference):
    """A stack that prefilled the documents (the last one also as tenant A),
    wrote them all to disk, then took a burst of new prompts and was SIGKILLed
    amid their writes. Yields (disk folder, its one fingerprint's folder, documents, burst prompts)."""
    workdir = tempfile.mkdtemp(prefix="kvd-disk-", dir="/tmp")
    disk = Path(workdir) / "disk"
    docs = documents(seed=1, count=DOCS)
    burst = documents(seed=2, count=3)
    daemon, engine = stack(os.path.join(workdir, "life1"), disk, model_dir, 64, 64)
    for ids in docs:
        tokens, usage = ask(engine, ids)
        assert tokens == reference(ids) and usage.disk_cached_prompt_tokens == 0
    assert ask(engine, docs[-1], TENANT_A)[0] == reference(docs[-1])
    full_blocks = sum(len(ids) // BLOCK for ids in docs) + len(docs[-1]) // BLOCK
    assert wait_for(lambda: stats(daemon).num_disk_blocks == full_blocks, 30), stats(daemon)
    client = stub(engine.address)
    for ids in burst:
        generate(client, request(ids, 1))
    wait_for(lambda: stats(daemon).disk_writes > full_blocks, 10, interval_s=0.001)
    daemon.stop(signal.SIGKILL)
    engine.stop(signal.SIGKILL)
    (folder,) = disk.iterdir()
    yield disk, folder, docs, burst
    shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(scope="module")
def second_life(first_life, model_dir):
    """The same folder after the SIGKILL, with document 1's third block file
    corrupted and document 2's first block file cut short."""
    disk, folder, docs, _ = first_life
    corrupt = block_files(folder, docs[1])[2]
    raw = bytearray(corrupt.read_bytes())
    raw[-10] ^= 0xFF
    corrupt.write_bytes(bytes(raw))
    torn = block_files(folder, docs[2])[0]
    torn.write_bytes(torn.read_bytes()[:1000])
    workdir = tempfile.mkdtemp(prefix="kvd-disk-", dir="/tmp")
    daemon, engine = stack(workdir, disk, model_dir, 64, 64)
    yield daemon, engine
    engine.stop()
    daemon.stop()
    shutil.rmtree(workdir, ignore_errors=True)


def test_after_sigkill_the_same_prompts_come_from_disk_token_exact(first_life, second_life, reference):
    _, _, docs, burst = first_life
    daemon, engine = second_life
    before = stats(daemon)
    assert before.num_disk_blocks >= sum(len(ids) // BLOCK for ids in docs) - 1  # the torn one dropped at start
    assert before.disk_index_rebuild_seconds > 0
    assert "disk tier index rebuilt" in daemon.log()
    served = {}
    for i in (0, 1, 2):
        tokens, usage = ask(engine, docs[i])
        assert tokens == reference(docs[i]), f"document {i} diverged after the restart"
        served[i] = usage.disk_cached_prompt_tokens
    assert served[0] == len(docs[0]) // BLOCK * BLOCK, "an intact document did not come whole from disk"
    assert served[1] == 2 * BLOCK, "blocks up to the corrupt one come from disk, the rest is recomputed"
    assert served[2] == 0, "a document whose first block file is torn is recomputed"
    after = stats(daemon)
    assert after.disk_corrupt_blocks == 2 and after.disk_hit_tokens == served[0] + served[1]
    for ids in burst:  # cut by the SIGKILL amid their writes: whatever is served is whole
        assert ask(engine, ids)[0] == reference(ids)
    assert wait_for(lambda: settled(daemon), 20) and blocks_held(daemon) == 0


def test_another_tenants_blocks_on_disk_are_no_hits(first_life, second_life, reference):
    _, _, docs, _ = first_life
    daemon, engine = second_life
    tokens, usage = ask(engine, docs[-1], TENANT_B)
    assert tokens == reference(docs[-1])
    assert usage.cached_prompt_tokens == 0 and usage.disk_cached_prompt_tokens == 0
    tokens, usage = ask(engine, docs[-1], TENANT_A)
    assert tokens == reference(docs[-1])
    assert usage.disk_cached_prompt_tokens == len(docs[-1]) // BLOCK * BLOCK


def test_another_layout_on_the_same_folder_serves_nothing_of_it(first_life, model_dir, reference):
    disk, _, docs, _ = first_life
    workdir = tempfile.mkdtemp(prefix="kvd-disk-", dir="/tmp")
    before = {p.name for p in disk.iterdir()}
    daemon = start_daemon(
        ["--block-size", "32", "--lease-s", "2", "--num-blocks", "64", "--host-num-blocks", "64",
         "--disk-path", str(disk), "--disk-budget", "4GiB"],
        workdir,
    )  # fmt: skip
    engine = start_engine(daemon, ["--model", str(model_dir), "--dtype", "float64"], workdir)
    try:
        assert stats(daemon).num_disk_blocks == 0
        tokens, usage = ask(engine, docs[0])
        assert tokens == reference(docs[0])
        assert usage.cached_prompt_tokens == 0 and usage.disk_cached_prompt_tokens == 0
        assert stats(daemon).disk_loads == 0
        assert len({p.name for p in disk.iterdir()} - before) == 1, "its blocks go under a folder of its own"
    finally:
        engine.stop()
        daemon.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def test_churn_past_device_and_host_cycles_through_disk(model_dir, reference):
    workdir = tempfile.mkdtemp(prefix="kvd-disk-", dir="/tmp")
    disk = Path(workdir) / "disk"
    docs = documents(seed=3, count=6, tokens=96)  # 36 document blocks; device 20, host 16
    rng = random.Random(4)
    prompts = [doc[:96] + [rng.randrange(100, 40000) for _ in range(rng.randrange(3, 12))] for doc in docs * 2]
    daemon, engine = stack(workdir, disk, model_dir, 20, 16)
    try:
        results = churn(engine.address, prompts, 0, seed=5)
        for ids, tokens, _ in results:
            assert tokens == reference(ids), f"a {len(ids)}-token prompt diverged"
        assert sum(usage.disk_cached_prompt_tokens for _, _, usage in results) > 0, "the disk tier served nothing"
        assert wait_for(lambda: settled(daemon), 20), "blocks stayed held or copying"
        s = stats(daemon)
        assert blocks_held(daemon) == 0 and s.num_host_blocks_read == 0 and s.disk_loads > 0
        assert s.num_host_free_blocks + s.num_host_cached_blocks == s.num_host_blocks, "a host slot is still loading"
    finally:
        engine.stop()
        daemon.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    return done.returncode == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting the small tmpfs that plays a full disk needs root")
def test_a_full_disk_stops_writes_and_serving_goes_on(model_dir, reference):
    workdir = tempfile.mkdtemp(prefix="kvd-disk-", dir="/tmp")
    disk = Path(workdir) / "disk"
    assert _mount_tmpfs(disk, "6m"), "mount -t tmpfs failed"  # room for 3 float64 blocks of SmolLM2
    try:
        daemon, engine = stack(workdir, disk, model_dir, 64, 64)
        try:
            docs = documents(seed=6, count=2)
            for ids in docs:
                assert ask(engine, ids)[0] == reference(ids)
            assert wait_for(lambda: not stats(daemon).disk_writes_enabled, 20), "writes were not disabled"
            s = stats(daemon)
            assert s.disk_write_errors >= 1 and 0 < s.num_disk_blocks < len(docs[0]) // BLOCK
            for ids in docs:  # served from the device and host tiers
                tokens, usage = ask(engine, ids)
                assert tokens == reference(ids) and usage.cached_prompt_tokens > 0
            assert daemon.log().count("disk tier writes disabled") == 1
            assert not list((next(p for p in disk.iterdir() if p.is_dir()) / disk_format.TMP_FOLDER).iterdir())
        finally:
            engine.stop()
            daemon.stop()
    finally:
        subprocess.run(["umount", str(disk)], check=False)
        shutil.rmtree(workdir, ignore_errors=True)


def test_events_metrics_and_lookup_report_the_disk_tier(first_life, second_life):
    _, folder, docs, _ = first_life
    daemon, _ = second_life
    on_disk = {p.stem for p in folder.rglob("*.kvb")}
    with DaemonClient.connect(daemon.address) as client:
        snapshot = []
        for batch in client.events():
            if not batch.snapshot:
                break
            snapshot += [e.stored for e in batch.events if e.HasField("stored") and e.stored.tier == pb.TIER_DISK]
            if len(snapshot) and sum(len(s.block_hashes) for s in snapshot) >= len(on_disk):
                break
        assert {h.hex() for s in snapshot for h in s.block_hashes} == on_disk
        reply = client.stub.Lookup(pb.LookupRequest(token_ids=docs[3], cache_salt=TENANT_A))
        assert reply.num_cached_tokens + reply.num_host_cached_tokens + reply.num_disk_cached_tokens == (
            len(docs[3]) // BLOCK * BLOCK
        )
    text = urllib.request.urlopen(f"http://127.0.0.1:{daemon.metrics_port}/metrics", timeout=5).read().decode()
    assert f"kvd_disk_blocks {float(stats(daemon).num_disk_blocks)}" in text
    assert 'kvd_tier_hit_tokens_total{tier="disk"}' in text and "kvd_disk_corrupt_blocks_total 2.0" in text


TEMPLATE = (
    "You are the archivist of the harbour office. You answer questions about ship arrivals, berth fees, "
    "tides and the storage of cargo politely and briefly, quoting the register where you can. "
) * 4


def test_a_pinned_template_comes_back_warm_from_disk_after_a_daemon_sigkill(stack_factory, workdir):
    disk_args = ["--host-num-blocks", "64", "--disk-path", f"{workdir}/disk", "--disk-budget", "1GiB"]
    engine = stack_factory(daemon_args=disk_args)
    gw = start_gateway(engine.address, ["--data-dir", f"{workdir}/gateway-data"], workdir)

    def pins() -> int:
        return stats(engine.daemon).num_pins

    try:
        with GatewayClient(gw.address, timeout_s=60) as client:
            expected = client.create_template("archive", TEMPLATE).cached_token_count
        assert expected >= 4 * BLOCK and pins() == 1
        assert wait_for(lambda: stats(engine.daemon).num_disk_blocks >= expected // BLOCK, 20)
        folder = engine.daemon.socket_path.rsplit("/", 1)[0]
        engine.daemon.stop(signal.SIGKILL)
        engine.daemon = start_daemon(["--block-size", str(BLOCK), "--lease-s", "2", *disk_args], folder)
        assert wait_for(lambda: pins() == 1, 60), f"not re-pinned after the daemon restart: {gw.log()}"
        after = stats(engine.daemon)
        assert after.disk_hit_tokens >= expected, "the template was recomputed, not read back from disk"
        with GatewayClient(gw.address, timeout_s=60) as client:
            usage = completion(client, " Which berth?", template="archive", max_new_tokens=1)[1]
        assert usage.cached_prompt_tokens >= expected
    finally:
        gw.stop()
        engine.daemon.stop()
