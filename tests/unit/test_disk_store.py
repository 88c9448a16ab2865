"""The disk tier's files (kvd/disk_store.py, kvd/disk_format.py): written whole,
read verified, torn or corrupt ones dropped, bounded with LRU across restarts,
one folder per fingerprint, and a full disk that only stops writes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvd import disk_format
from kvd.common.identity import ModelIdentity
from kvd.common.layout import CacheLayout
from kvd.disk_store import DiskStore

PAYLOAD = 4096
FILE = disk_format.file_size(b"h" * 32, PAYLOAD)


def block(i: int) -> tuple[bytes, bytes]:
    """A block hash and its payload, both made from ``i``."""
    return i.to_bytes(32, "little"), bytes((i + j) % 251 for j in range(PAYLOAD))


def read(store: DiskStore, block_hash: bytes) -> bytes | None:
    out = bytearray(PAYLOAD)
    (ok,) = store.read_batch([(block_hash, memoryview(out))])
    return bytes(out) if ok else None


def store_at(root: Path, budget_blocks: int = 100, fingerprint: str = "f" * 32, **kw) -> DiskStore:
    return DiskStore(root, fingerprint, PAYLOAD, budget_blocks * FILE, **kw)


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "buffered"])
def test_a_block_written_is_read_back_the_same(tmp_path, direct):
    store = store_at(tmp_path)
    assert store._direct  # a page-sized payload on a disk: read with O_DIRECT unless told not to
    store._direct = direct
    h, data = block(1)
    store.write(h, memoryview(data))
    assert store.holds(h)
    assert read(store, h) == data
    assert store.bytes_written == FILE and store.bytes_read == FILE
    assert not list((store.folder / disk_format.TMP_FOLDER).iterdir()), "no temporary file is left"


def test_the_index_is_rebuilt_from_the_folder_in_lru_order(tmp_path):
    store = store_at(tmp_path, budget_blocks=3)
    for i in range(3):
        h, data = block(i)
        store.write(h, memoryview(data))
        time.sleep(0.01)  # distinct mtimes
    assert read(store, block(0)[0]) is not None  # read: now the most recent
    again = store_at(tmp_path, budget_blocks=3)
    assert list(again.index) == [block(1)[0], block(2)[0], block(0)[0]]
    again.write(block(3)[0], memoryview(block(3)[1]))  # over budget: block 1 goes, the least recently used
    assert not again.holds(block(1)[0]) and again.holds(block(0)[0])
    assert again.num_evictions == 1
    assert again.used_bytes == 3 * FILE


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "buffered"])
@pytest.mark.parametrize("damage", ["truncate", "flip", "longer", "header"])
def test_a_torn_or_corrupt_file_is_dropped_not_served(tmp_path, damage, direct):
    store = store_at(tmp_path)
    store._direct = direct
    h, data = block(7)
    store.write(h, memoryview(data))
    path = store.folder / disk_format.file_name(h)
    raw = bytearray(path.read_bytes())
    if damage == "truncate":
        raw = raw[: len(raw) // 2]
    elif damage == "flip":
        raw[-100] ^= 0xFF
    elif damage == "longer":
        raw += b"x"
    else:
        raw[0:4] = b"XXXX"
    path.write_bytes(bytes(raw))
    if damage in ("truncate", "longer"):  # the size tells at start already
        store = store_at(tmp_path)
        assert not store.holds(h) and store.num_corrupt == 1
        path.write_bytes(bytes(raw))  # as if it had been damaged after the start: the read tells too
        store.index[h] = FILE
        assert read(store, h) is None and store.num_corrupt == 2
    else:
        assert read(store, h) is None
        assert store.num_corrupt == 1 and not store.holds(h)
    assert not path.exists()


def test_temporary_files_of_a_crash_are_removed_at_start(tmp_path):
    store = store_at(tmp_path)
    (store.folder / disk_format.TMP_FOLDER / "half-written").write_bytes(b"x" * 100)
    again = store_at(tmp_path)
    assert not list((again.folder / disk_format.TMP_FOLDER).iterdir())
    assert len(again) == 0


def test_another_fingerprint_is_never_read_and_evicted_first(tmp_path):
    first = store_at(tmp_path, budget_blocks=2, fingerprint="a" * 32)
    for i in range(2):
        first.write(block(i)[0], memoryview(block(i)[1]))
    second = store_at(tmp_path, budget_blocks=2, fingerprint="b" * 32)
    assert len(second) == 0 and not second.holds(block(0)[0])
    assert second.used_bytes == 2 * FILE  # the other's files count against the budget
    second.write(block(5)[0], memoryview(block(5)[1]))
    assert second.used_bytes == 2 * FILE
    assert len(list((tmp_path / ("a" * 32)).rglob("*.kvb"))) == 1  # one of the other's went first
    third = store_at(tmp_path, budget_blocks=2, fingerprint="c" * 32, remove_others=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c" * 32]
    assert third.used_bytes == 0


def test_fingerprint_names_model_layout_and_format():
    model = ModelIdentity("m", "llama", b"c" * 32, b"w" * 32, b"t" * 32)
    layout = CacheLayout(2, 2, 8, 16, "float32")
    base = disk_format.fingerprint(model, layout)
    assert base == disk_format.fingerprint(model, layout)
    others = [
        disk_format.fingerprint(ModelIdentity("m", "llama", b"c" * 32, b"W" * 32, b"t" * 32), layout),
        disk_format.fingerprint(ModelIdentity("m", "llama", b"c" * 32, b"w" * 32, b"T" * 32), layout),
        disk_format.fingerprint(model, CacheLayout(2, 2, 8, 32, "float32")),
        disk_format.fingerprint(model, CacheLayout(2, 2, 8, 16, "bfloat16")),
        disk_format.fingerprint(model, CacheLayout(3, 2, 8, 16, "float32")),
    ]
    assert len({base, *others}) == 6


def test_clear_removes_every_block(tmp_path):
    store = store_at(tmp_path)
    for i in range(3):
        store.write(block(i)[0], memoryview(block(i)[1]))
    assert sorted(store.clear()) == sorted(block(i)[0] for i in range(3))
    assert store.used_bytes == 0 and not list(store.folder.rglob("*.kvb"))


_FULL_DISK = """
import sys, resource
from kvd.disk_store import DiskStore
from tests.unit.test_disk_store import block, PAYLOAD, FILE, read
root = sys.argv[1]
store = DiskStore(root, "f" * 32, PAYLOAD, 100 * FILE)
store.write(block(0)[0], memoryview(block(0)[1]))
# Past this size a write fails with EFBIG (Python ignores SIGXFSZ), as on a full disk.
resource.setrlimit(resource.RLIMIT_FSIZE, (FILE // 2, FILE // 2))
try:
    store.write(block(1)[0], memoryview(block(1)[1]))
except OSError as exc:
    print("failed", exc.errno)
assert not store.holds(block(1)[0]) and store.used_bytes == FILE
assert read(store, block(0)[0]) == block(0)[1]
print("served")
"""


def test_a_full_disk_fails_the_write_whole_and_reads_go_on(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", _FULL_DISK, str(tmp_path)], capture_output=True, text=True, timeout=60,
        cwd=Path(__file__).parents[2],
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["failed", str(27), "served"]  # EFBIG
    assert not list((tmp_path / ("f" * 32) / disk_format.TMP_FOLDER).iterdir()), "the torn write is removed"
    assert os.path.getsize(next((tmp_path / ("f" * 32)).rglob("*.kvb"))) == FILE
