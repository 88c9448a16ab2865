"""Chained block hashes: the identity of cached KV content.

A block's hash is ``sha256(parent_digest ‖ extra_keys ‖ token_ids)`` where the
token ids are little-endian uint32 and ``extra_keys`` is a length-prefixed
encoding of the cache salt and any further namespaces. Chaining makes a hash
identify the whole prefix up to and including its block, so a lookup can walk
a prompt's blocks and stop at the first miss. Python's ``hash()`` is never
used: a collision would hand one request another request's KV.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence

#: The parent of every chain's first block. Versioned so that a change of the
#: encoding can never match hashes made by an older daemon.
ROOT_HASH = hashlib.sha256(b"kvd/block-hash/v1").digest()

MAX_TOKEN_ID = 2**32 - 1

_sha256 = hashlib.sha256


def encode_extra_keys(cache_salt: bytes = b"", extra_keys: Sequence[bytes] = ()) -> bytes:
    """Encodes the hash namespaces of a request, unambiguously.

    Each part is prefixed by its length, and the number of parts comes first,
    so no two different (salt, keys) tuples encode to the same bytes.
    """
    parts = (bytes(cache_salt), *(bytes(key) for key in extra_keys))
    encoded = [len(parts).to_bytes(4, "little")]
    for part in parts:
        encoded.append(len(part).to_bytes(4, "little"))
        encoded.append(part)
    return b"".join(encoded)


def pack_tokens(token_ids: Sequence[int]) -> array:
    """Token ids as a compact ``array('I')``, each checked on the way in.

    Raises:
        ValueError: a token id that is not an integer in [0, 2**32).
    """
    if isinstance(token_ids, bytes | bytearray | memoryview):
        # array() would read raw bytes as packed integers, not one id per byte.
        token_ids = list(token_ids)
    try:
        packed = array("I", token_ids)
    except (OverflowError, TypeError) as exc:
        raise ValueError(f"token ids must be integers in [0, {MAX_TOKEN_ID}]: {exc}") from None
    assert packed.itemsize == 4, "array('I') must be 32-bit on this platform"
    return packed


def token_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids as fixed-width little-endian uint32 bytes.

    Raises:
        ValueError: a token id that is not an integer in [0, 2**32).
    """
    return _little_endian(pack_tokens(token_ids))


def hash_blocks(
    packed: array,
    block_size: int,
    extra: bytes,
    parent: bytes = ROOT_HASH,
    start_block: int = 0,
    end_block: int | None = None,
) -> list[bytes]:
    """Hashes full blocks of already checked token ids (``pack_tokens``).

    Args:
        packed: the whole sequence's ids.
        block_size: tokens per block.
        extra: ``encode_extra_keys(...)`` of the request.
        parent: the hash of block ``start_block - 1`` (``ROOT_HASH`` for 0).
        start_block: the first block to hash.
        end_block: the block to stop before (default: every full block).

    Returns:
        One 32-byte digest per block in ``[start_block, end_block)``.
    """
    num_full = len(packed) // block_size
    end = num_full if end_block is None else min(end_block, num_full)
    if end <= start_block:
        return []
    data = _little_endian(packed[start_block * block_size : end * block_size])
    width = 4 * block_size
    # NOTE: this loop is about half of a cold 2k-token prompt's admission: the
    # rows are cut in one comprehension and the loop body is one digest.
    rows = [extra + data[offset : offset + width] for offset in range(0, len(data), width)]
    hashes: list[bytes] = []
    append = hashes.append
    sha256 = _sha256
    for row in rows:
        parent = sha256(parent + row).digest()
        append(parent)
    return hashes


def chain_block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    extra: bytes,
    parent: bytes = ROOT_HASH,
    start_block: int = 0,
) -> list[bytes]:
    """Hashes the full blocks of ``token_ids`` from ``start_block`` on (only
    their ids are checked: a partial last block is left as it is).

    Args:
        token_ids: the whole sequence.
        block_size: tokens per block.
        extra: ``encode_extra_keys(...)`` of the request.
        parent: the hash of block ``start_block - 1`` (``ROOT_HASH`` for 0).
        start_block: the first block to hash.

    Returns:
        One 32-byte digest per full block from ``start_block`` on.
    """
    num_full = len(token_ids) // block_size
    if num_full <= start_block:
        return []
    packed = pack_tokens(token_ids[start_block * block_size : num_full * block_size])
    return hash_blocks(packed, block_size, extra, parent)


def _little_endian(packed: array) -> bytes:
    if sys.byteorder != "little":  # pragma: no cover
        packed = array("I", packed)
        packed.byteswap()
    return packed.tobytes()
