"""The disk tier's files: one per block under the cache's fingerprint, an index
of them rebuilt from the folder at start, and the budget they share.

One file per block was chosen by measurement (docs/benchmarks.md, the
``disk`` workload): a block is ~0.1-1 MiB, large enough that reading one file
runs at the disk's sequential bandwidth, and a file per block makes a write
atomic by rename and an eviction one unlink, with no allocator of its own.

Least recently used goes first, across restarts too: a file's mtime is when
it was written or last read (a read touches it), and the index is rebuilt in
mtime order. Files of other fingerprints (another model, layout or format)
are never read; they count against the budget and are evicted first, oldest
first (or removed at start with ``remove_others``).

Thread-safe: the writer and reader threads and the daemon's lookups share it.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import shutil
import threading
import time
import uuid
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kvd import disk_format

log = logging.getLogger("kvd.disk")

#: Block files read at once by a load: a disk serves several queued reads
#: faster than one at a time (measured: benchmarks/offload.py --workload
#: restart, docs/benchmarks.md); the reads release the GIL.
READ_THREADS = 8


class DiskStore:
    """Block files of one fingerprint under ``root``, bounded by ``budget_bytes``.

    Args:
        root: the disk tier's folder (``--disk-path``); created if missing.
        fingerprint: this cache's folder name (``disk_format.fingerprint``).
        payload_bytes: one block's bytes.
        budget_bytes: what every block file under ``root`` may take together.
        remove_others: delete other fingerprints' folders at start.
    """

    def __init__(
        self, root: str | Path, fingerprint: str, payload_bytes: int, budget_bytes: int, remove_others: bool = False
    ) -> None:
        self.root = Path(root)
        self.folder = self.root / fingerprint
        self.payload_bytes = payload_bytes
        self.budget_bytes = budget_bytes
        self._lock = threading.Lock()
        self.index: OrderedDict[bytes, int] = OrderedDict()  # hash -> file bytes, least recent first
        self._others: list[tuple[Path, int]] = []  # other fingerprints' files, oldest first
        self.used_bytes = 0
        self.num_evictions = 0
        self.num_corrupt = 0
        self.bytes_written = 0
        self.bytes_read = 0
        self.seconds_reading = 0.0
        self.rebuild_seconds = 0.0
        self._readers = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="kvd-disk-read")
        # O_DIRECT needs page-aligned offsets and lengths: the header is a
        # page, the payload must be whole pages. Off after a filesystem refuses it (tmpfs).
        self._direct = hasattr(os, "O_DIRECT") and payload_bytes % mmap.PAGESIZE == 0
        self._local = threading.local()  # each read thread's page-aligned buffer
        self._open(remove_others)

    # ------------------------------------------------------------ start

    def _open(self, remove_others: bool) -> None:
        started = time.perf_counter()
        self.folder.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(self.folder / disk_format.TMP_FOLDER, ignore_errors=True)  # writes a crash cut short
        (self.folder / disk_format.TMP_FOLDER).mkdir()
        found, dropped = self._scan_own()
        for _, block_hash, size in sorted(found):
            self.index[block_hash] = size
            self.used_bytes += size
        removed = self._scan_others(remove_others)
        self.rebuild_seconds = time.perf_counter() - started
        log.info(
            "disk tier index rebuilt",
            extra={"folder": str(self.folder), "blocks": len(self.index), "bytes": self.used_bytes,
                   "dropped_torn": dropped, "other_fingerprint_files": len(self._others),
                   "other_fingerprints_removed": removed, "seconds": round(self.rebuild_seconds, 4)},
        )  # fmt: skip

    def _scan_own(self) -> tuple[list[tuple[float, bytes, int]], int]:
        """(mtime, hash, size) of every complete-sized block file; torn ones removed."""
        found, dropped = [], 0
        for sub in os.scandir(self.folder):
            if not sub.is_dir() or sub.name == disk_format.TMP_FOLDER:
                continue
            for entry in os.scandir(sub.path):
                block_hash = disk_format.hash_of(entry.name)
                if block_hash is None:
                    continue
                stat = entry.stat()
                if stat.st_size != disk_format.file_size(block_hash, self.payload_bytes):
                    os.unlink(entry.path)  # cut short (or another layout's, which cannot be here): never served
                    dropped += 1
                    continue
                found.append((stat.st_mtime, block_hash, stat.st_size))
        self.num_corrupt += dropped
        return found, dropped

    def _scan_others(self, remove: bool) -> int:
        others, removed = [], 0
        for entry in os.scandir(self.root):
            if not entry.is_dir() or entry.path == str(self.folder):
                continue
            if remove:
                shutil.rmtree(entry.path, ignore_errors=True)
                removed += 1
                continue
            for dirpath, _, names in os.walk(entry.path):
                for name in names:
                    path = Path(dirpath) / name
                    stat = path.stat()
                    others.append((stat.st_mtime, path, stat.st_size))
        others.sort()
        self._others = [(path, size) for _, path, size in others]
        self.used_bytes += sum(size for _, size in self._others)
        return removed

    # ------------------------------------------------------------ lookups

    def holds(self, block_hash: bytes) -> bool:
        return block_hash in self.index

    def __len__(self) -> int:
        return len(self.index)

    def hashes(self) -> list[bytes]:
        with self._lock:
            return list(self.index)

    # ------------------------------------------------------------ writing

    def write(self, block_hash: bytes, payload: memoryview) -> list[bytes] | None:
        """Writes one block's file, visible only once complete and fsynced.

        Returns: the hashes evicted to make room; None when nothing was
        written (the block is here already, or larger than the whole budget).

        Raises:
            OSError: the disk is full or failed; nothing of the block is left.
        """
        size = disk_format.file_size(block_hash, payload.nbytes)
        if size > self.budget_bytes:
            return None
        with self._lock:
            if block_hash in self.index:
                return None
            evicted = self._make_room(size)
        tmp = self.folder / disk_format.TMP_FOLDER / uuid.uuid4().hex
        target = self.folder / disk_format.file_name(block_hash)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                _write_all(fd, disk_format.header(block_hash, payload))
                _write_all(fd, payload)
                os.fsync(fd)
                # NOTE: written blocks are read back only after they left the
                # host tier, often after a restart: keeping them in the page
                # cache would only crowd out what the machine needs now.
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
            target.parent.mkdir(exist_ok=True)
            os.rename(tmp, target)
        except OSError:
            tmp.unlink(missing_ok=True)
            with self._lock:
                self.used_bytes -= size
            raise
        with self._lock:
            self.index[block_hash] = size
            self.bytes_written += size
        return evicted

    def sync_folders(self, block_hashes: list[bytes]) -> None:
        """Makes the renames of a batch of writes durable: their folders, and
        the fingerprint's folder (which may have gained one)."""
        folders = {(self.folder / disk_format.file_name(h)).parent for h in block_hashes}
        for path in (*folders, self.folder):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def _make_room(self, size: int) -> list[bytes]:
        """Reserves ``size`` bytes, evicting other fingerprints' files, then
        the least recently used blocks. Under the lock."""
        evicted = []
        while self.used_bytes + size > self.budget_bytes:
            if self._others:
                path, other_size = self._others.pop(0)
                path.unlink(missing_ok=True)
                self.used_bytes -= other_size
                continue
            if not self.index:
                break
            old_hash, old_size = self.index.popitem(last=False)
            (self.folder / disk_format.file_name(old_hash)).unlink(missing_ok=True)
            self.used_bytes -= old_size
            self.num_evictions += 1
            evicted.append(old_hash)
        self.used_bytes += size
        return evicted

    # ------------------------------------------------------------ reading

    def read_batch(self, jobs: list[tuple[bytes, memoryview]]) -> list[bool]:
        """Reads each block's payload into its ``out`` (``payload_bytes``), verified.

        READ_THREADS threads read them, with O_DIRECT where the filesystem
        allows it (else every file's read is started at once first,
        POSIX_FADV_WILLNEED, so the disk sees them queued, not one small
        readahead at a time).

        Returns: per job, False when the block is gone, or its file was torn
        or corrupt (then removed and counted: the block is recomputed).
        """
        started = time.perf_counter()
        for block_hash, _ in jobs if not self._direct else ():
            with contextlib.suppress(OSError):  # a missing file is found by its read
                fd = os.open(self.folder / disk_format.file_name(block_hash), os.O_RDONLY)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
                os.close(fd)
        results = list(self._readers.map(lambda job: self._read_into(*job), jobs))
        with self._lock:
            self.seconds_reading += time.perf_counter() - started
        return results

    def _read_into(self, block_hash: bytes, out: memoryview) -> bool:
        path = self.folder / disk_format.file_name(block_hash)
        try:
            got = self._read_direct(path, block_hash, out) if self._direct else 0
            if not got:
                got = self._read_buffered(path, block_hash, out)
            os.utime(path)  # read now: the last to be evicted, after a restart too
        except FileNotFoundError:
            self._forget(block_hash)
            return False
        except (OSError, disk_format.CorruptBlock) as exc:
            log.warning("disk block dropped", extra={"block": block_hash.hex()[:16], "why": str(exc)})
            path.unlink(missing_ok=True)
            self._forget(block_hash)
            with self._lock:
                self.num_corrupt += 1
            return False
        with self._lock:
            if block_hash in self.index:
                self.index.move_to_end(block_hash)
            self.bytes_read += got
        return True

    def _read_direct(self, path: Path, block_hash: bytes, out: memoryview) -> int:
        """Reads the file with O_DIRECT (no page cache) into this thread's
        aligned buffer, checks it, copies the payload out; returns the file's
        bytes (0: the filesystem refuses O_DIRECT, read it buffered)."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            self._direct = False
            return 0
        try:
            view = self._buffer()
            got = 0
            while got < view.nbytes:
                try:
                    n = os.preadv(fd, [view[got:]], got)
                except OSError as exc:  # some filesystems refuse O_DIRECT only when read
                    if exc.errno != errno.EINVAL:
                        raise
                    self._direct = False
                    return 0
                got += n
                if n == 0 or got % mmap.PAGESIZE:  # the end of the file
                    break
        finally:
            os.close(fd)
        size = disk_format.file_size(block_hash, self.payload_bytes)
        if got != size:
            raise disk_format.CorruptBlock(f"{got} bytes where {size} belong")
        checksum = disk_format.check_header(view[: disk_format.HEADER_BYTES], block_hash, self.payload_bytes)
        payload = view[disk_format.HEADER_BYTES : size]
        disk_format.check_payload(payload, payload.nbytes, checksum)
        out[:] = payload
        return got

    def _buffer(self) -> memoryview:
        """This thread's page-aligned buffer: a file and a page more (a longer file shows)."""
        buffer = getattr(self._local, "buffer", None)
        if buffer is None:
            size = disk_format.HEADER_BYTES + self.payload_bytes + mmap.PAGESIZE
            buffer = self._local.buffer = memoryview(mmap.mmap(-1, size))
        return buffer

    def _read_buffered(self, path: Path, block_hash: bytes, out: memoryview) -> int:
        head = memoryview(bytearray(disk_format.HEADER_BYTES))
        with open(path, "rb", buffering=0) as file:
            checksum = disk_format.check_header(head[: _read_all(file, head)], block_hash, self.payload_bytes)
            got = _read_all(file, out)
            if file.read(1):
                raise disk_format.CorruptBlock("longer than its header says")
            # NOTE: its bytes live in the host tier now; the page cache
            # need not keep a second copy (nor make the next read look fast).
            os.posix_fadvise(file.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            disk_format.check_payload(out, got, checksum)
        return head.nbytes + got

    def _forget(self, block_hash: bytes) -> None:
        with self._lock:
            size = self.index.pop(block_hash, None)
            if size is not None:
                self.used_bytes -= size

    def close(self) -> None:
        self._readers.shutdown(wait=True)

    def clear(self) -> list[bytes]:
        """Removes every block of this fingerprint; returns their hashes."""
        with self._lock:
            hashes = list(self.index)
            for block_hash in hashes:
                (self.folder / disk_format.file_name(block_hash)).unlink(missing_ok=True)
                self.used_bytes -= self.index.pop(block_hash)
            return hashes


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data).cast("B")
    while view:
        view = view[os.write(fd, view) :]


def _read_all(file, view: memoryview) -> int:
    got = 0
    while got < view.nbytes:
        n = file.readinto(view[got:])
        if not n:
            break
        got += n
    return got
