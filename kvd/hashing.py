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


def token_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids as fixed-width little-endian uint32 bytes.

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
    if sys.byteorder != "little":  # pragma: no cover
        packed.byteswap()
    return packed.tobytes()


def chain_block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    extra: bytes,
    parent: bytes = ROOT_HASH,
    start_block: int = 0,
) -> list[bytes]:
    """Hashes the full blocks of ``token_ids`` from ``start_block`` on.

    Args:
        token_ids: the whole sequence (only full blocks are hashed).
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
    data = token_bytes(token_ids[start_block * block_size : num_full * block_size])
    width = 4 * block_size
    hashes: list[bytes] = []
    append = hashes.append  # NOTE: ~30% of a 2k-token prompt's admission is this loop
    sha256 = _sha256
    for offset in range(0, len(data), width):
        parent = sha256(parent + extra + data[offset : offset + width]).digest()
        append(parent)
    return hashes


def sequence_block_hashes(token_ids: Sequence[int], block_size: int, extra: bytes) -> list[bytes]:
    """Validates every token id of a sequence and hashes its full blocks.

    Raises:
        ValueError: a token id that is not an integer in [0, 2**32).
    """
    hashes = chain_block_hashes(token_ids, block_size, extra)
    tail = token_ids[len(hashes) * block_size :]
    if len(tail):  # the full blocks were validated by hashing them
        token_bytes(tail)
    return hashes
