"""The disk tier's bytes on disk: the folder a cache's blocks live in, and one block's file.

Layout under ``--disk-path``::

    DIR/<fingerprint>/<first two hex digits of the hash>/<block hash hex>.kvb
    DIR/<fingerprint>/.tmp/<random>          (a write in progress; removed at start)

The **fingerprint** names everything that makes a block's bytes meaningful:
the model (its config, weights and tokenizer digests, ``kvd.common.identity``), the
cache layout (layers, KV heads, head dim, block size, dtype) and this file's
format version. A daemon reads only its own fingerprint's folder, so a block
of another model, layout or format is never served; the tenant is already in
the block hash (its cache salt and extra keys are hashed into every block).

One block's file::

    magic "KVDB" | version u16 | reserved u16 | payload bytes u64 |
    xxh3-64 of the payload u64 | block hash length u16 | block hash |
    zeros to 4,096 bytes | payload

The header fills a page so that the payload starts page-aligned: a block
whose size is a multiple of the page is read with O_DIRECT, straight from
the disk as ``dd iflag=direct`` reads (kvd/disk_store.py).

A file becomes visible (renamed into place) only after its bytes were written
and fsynced, so a crash leaves either nothing or a whole file; the checksum,
verified on every read, catches what a disk or a hand did to it since.
"""

from __future__ import annotations

import hashlib
import struct

import xxhash

from kvd.common.identity import ModelIdentity
from kvd.common.layout import CacheLayout

#: Bumped whenever the file layout or the meaning of its payload changes:
#: it is part of the fingerprint, so older files are never read as newer ones.
FORMAT_VERSION = 1

MAGIC = b"KVDB"
SUFFIX = ".kvb"
TMP_FOLDER = ".tmp"
_HEADER = struct.Struct("<4sHHQQH")
#: The header's bytes on disk, padding included: one page.
HEADER_BYTES = 4096


class CorruptBlock(ValueError):
    """A block file whose header or checksum does not hold: it is never served."""


def fingerprint(model: ModelIdentity, layout: CacheLayout) -> str:
    """The folder name of blocks made by ``model`` in ``layout`` (hex, 32 digits)."""
    digest = hashlib.sha256(b"kvd/disk-tier")
    digest.update(FORMAT_VERSION.to_bytes(4, "little"))
    digest.update(bytes.fromhex(model.fingerprint()))
    for value in (layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.block_size):
        digest.update(value.to_bytes(4, "little"))
    digest.update(layout.dtype.encode())
    return digest.hexdigest()[:32]


def file_name(block_hash: bytes) -> str:
    """The block's path relative to its fingerprint's folder."""
    text = block_hash.hex()
    return f"{text[:2]}/{text}{SUFFIX}"


def hash_of(name: str) -> bytes | None:
    """The block hash a file name holds (None: not a block file)."""
    if not name.endswith(SUFFIX):
        return None
    try:
        return bytes.fromhex(name[: -len(SUFFIX)])
    except ValueError:
        return None


def file_size(block_hash: bytes, payload_bytes: int) -> int:
    """The size a complete file of this block has (a shorter one is torn)."""
    return HEADER_BYTES + payload_bytes


def header(block_hash: bytes, payload: memoryview) -> bytes:
    """The bytes written before the payload."""
    checksum = xxhash.xxh3_64_intdigest(payload)
    packed = _HEADER.pack(MAGIC, FORMAT_VERSION, 0, payload.nbytes, checksum, len(block_hash)) + block_hash
    return packed.ljust(HEADER_BYTES, b"\0")


def check_header(head: memoryview, block_hash: bytes, payload_bytes: int) -> int:
    """The payload's checksum, from a file's first ``HEADER_BYTES``, checked.

    Raises:
        CorruptBlock: a short header, another magic or version, another hash
            or another payload size.
    """
    if head.nbytes < HEADER_BYTES:
        raise CorruptBlock(f"{head.nbytes} bytes: shorter than a header")
    magic, version, _, size, checksum, hash_len = _HEADER.unpack_from(head)
    if magic != MAGIC or version != FORMAT_VERSION:
        raise CorruptBlock(f"magic {magic!r} version {version}: not a v{FORMAT_VERSION} block file")
    if hash_len != len(block_hash) or bytes(head[_HEADER.size : _HEADER.size + hash_len]) != block_hash:
        raise CorruptBlock("the file holds another block hash than its name")
    if size != payload_bytes:
        raise CorruptBlock(f"a payload of {size} bytes; the cache's are {payload_bytes}")
    return checksum


def check_payload(payload: memoryview, got: int, checksum: int) -> None:
    """Raises CorruptBlock unless ``got`` bytes filled ``payload`` and their checksum matches."""
    if got != payload.nbytes:
        raise CorruptBlock(f"{got} payload bytes where {payload.nbytes} belong")
    if xxhash.xxh3_64_intdigest(payload) != checksum:
        raise CorruptBlock("checksum mismatch")
