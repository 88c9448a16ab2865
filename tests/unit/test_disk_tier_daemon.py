"""The disk tier through an in-process daemon (kvd/disk_tier.py): blocks written
through from the host tier, a new daemon on the same folder loading them back
before admission with their bytes, a corrupt block dropped and recomputed, a
daemon without a model identity or of another model serving nothing."""

from __future__ import annotations

import pytest
import torch

from kvd import disk_format
from kvd.common.hashing import BlockHasher, encode_extra_keys, pack_tokens
from kvd.common.identity import ModelIdentity
from kvd.common.layout import CacheLayout
from kvd.config import DaemonConfig
from kvd.daemon import Daemon
from kvd_api.daemon.v1 import daemon_pb2 as pb
from tests.unit.test_host_tier import block_ids, run

BS = 4
LAYOUT = CacheLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_size=BS, dtype="float32")
MODEL = ModelIdentity("m", "llama", b"c" * 32, b"w" * 32, b"t" * 32)
DOC = list(range(100, 112))  # three full blocks


def make_daemon(tmp_path, disk, model=MODEL) -> tuple[Daemon, object, torch.Tensor]:
    config = DaemonConfig(
        block_size=BS, num_blocks=8, shm_dir=str(tmp_path), model_layout=LAYOUT, host_num_blocks=8,
        disk_path=str(disk), disk_budget_bytes=1 << 30,
    )  # fmt: skip
    tmp_path.mkdir(exist_ok=True)
    daemon = Daemon(config)
    session, memory = daemon.attach("test", None, model=model)
    return daemon, session, memory.tensor


def prefill(daemon, session, cache, request_id: str, ids: list[int]) -> None:
    """Runs ``ids`` through; the "engine" writes block i's bytes as i + 1."""
    out = run(daemon, session, new=(request_id, ids))
    for i, block_id in enumerate(block_ids(out)):
        cache[block_id].fill_(float(i + 1))
    run(daemon, session, done=(request_id, len(ids)), finished=[request_id])
    assert daemon.wait_for_copies()


def ask_until_admitted(daemon, session, request_id: str, ids: list[int]) -> pb.StepResponse:
    """Steps until the request is scheduled (it waits while its blocks load from disk)."""
    out = run(daemon, session, new=(request_id, ids))
    for _ in range(50):
        if out.scheduled.request_ids:
            return out
        assert daemon.wait_for_copies()
        out = run(daemon, session)
    raise AssertionError("never admitted")


@pytest.fixture
def disk(tmp_path):
    return tmp_path / "disk"


def test_blocks_come_back_from_disk_after_a_restart_with_their_bytes(tmp_path, disk):
    first, session, cache = make_daemon(tmp_path / "a", disk)
    prefill(first, session, cache, "a", DOC + [1])
    assert first.stats().num_disk_blocks == 3 and first.stats().disk_writes == 3
    first.close()
    second, session, cache = make_daemon(tmp_path / "b", disk)
    assert second.stats().num_disk_blocks == 3
    first_reply = run(second, session, new=("b", DOC + [2]))
    assert not first_reply.scheduled.request_ids, "it waits while its blocks load"
    assert second.wait_for_copies()
    out = run(second, session)
    s = out.scheduled
    assert s.num_cached_tokens[0] == 12 and s.num_host_cached_tokens[0] == 12 and s.num_disk_cached_tokens[0] == 12
    for i, block_id in enumerate(block_ids(out)[:3]):
        assert torch.equal(cache[block_id], torch.full_like(cache[block_id], float(i + 1)))
    run(second, session, finished=["b"])
    assert second.wait_for_copies()
    stats = second.stats()
    assert stats.disk_hit_tokens == 12 and stats.disk_loads == 3 and stats.num_host_blocks_read == 0
    assert stats.num_used_blocks == 0 and stats.disk_writes == 0, "blocks read from disk are not written again"
    second.close()


def test_a_corrupt_block_is_dropped_and_the_rest_recomputed(tmp_path, disk):
    first, session, cache = make_daemon(tmp_path / "a", disk)
    prefill(first, session, cache, "a", DOC + [1])
    first.close()
    (folder,) = disk.iterdir()
    hashes = BlockHasher(encode_extra_keys(b"", ()), BS).advance(pack_tokens(DOC))
    second_block = folder / disk_format.file_name(hashes[1])
    raw = bytearray(second_block.read_bytes())
    raw[-1] ^= 1
    second_block.write_bytes(bytes(raw))
    second, session, cache = make_daemon(tmp_path / "b", disk)
    out = ask_until_admitted(second, session, "b", DOC + [2])
    assert out.scheduled.num_disk_cached_tokens[0] == 4, "only the block before the corrupt one"
    assert out.scheduled.first_positions[0] == 4
    stats = second.stats()
    assert stats.disk_corrupt_blocks == 1 and stats.num_disk_blocks == 2
    assert stats.num_host_free_blocks + stats.num_host_cached_blocks == stats.num_host_blocks, "a slot stayed loading"
    run(second, session, finished=["b"])
    second.close()


def test_another_model_on_the_same_folder_loads_nothing(tmp_path, disk):
    first, session, cache = make_daemon(tmp_path / "a", disk)
    prefill(first, session, cache, "a", DOC + [1])
    first.close()
    other = ModelIdentity("m", "llama", b"c" * 32, b"W" * 32, b"t" * 32)
    second, session, cache = make_daemon(tmp_path / "b", disk, model=other)
    out = run(second, session, new=("b", DOC + [2]))
    assert out.scheduled.num_cached_tokens[0] == 0 and not out.scheduled.num_disk_cached_tokens
    assert second.stats().num_disk_blocks == 0 and second.stats().disk_loads == 0
    assert len(list(disk.iterdir())) == 2 and disk_format.fingerprint(MODEL, LAYOUT) in {p.name for p in disk.iterdir()}
    second.close()


def test_without_a_model_identity_there_is_no_disk_tier(tmp_path, disk):
    daemon, session, cache = make_daemon(tmp_path / "a", disk, model=None)
    prefill(daemon, session, cache, "a", DOC + [1])
    assert daemon.cache.disk is None and daemon.stats().num_disk_blocks == 0
    daemon.close()


def test_reset_empties_the_disk_tier_too(tmp_path, disk):
    daemon, session, cache = make_daemon(tmp_path / "a", disk)
    prefill(daemon, session, cache, "a", DOC + [1])
    daemon.reset()
    assert daemon.stats().num_disk_blocks == 0 and not list(disk.rglob("*.kvb"))
    daemon.close()
