"""Chained block hashes: the chain property, the exact byte encoding, and input validation."""

from __future__ import annotations

import hashlib
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvd.hashing import (
    MAX_TOKEN_ID,
    ROOT_HASH,
    chain_block_hashes,
    encode_extra_keys,
    hash_blocks,
    pack_tokens,
    token_bytes,
)

BS = 4
NO_EXTRA = encode_extra_keys()

_tokens = st.lists(st.integers(0, MAX_TOKEN_ID), min_size=0, max_size=6 * BS)


# ------------------------------------------------------------- encoding pins


def test_root_hash_is_the_versioned_seed():
    assert hashlib.sha256(b"kvd/block-hash/v1").digest() == ROOT_HASH


def test_first_block_digest_matches_the_documented_byte_encoding():
    # sha256(parent ‖ extra ‖ uint32-le tokens), with extra = (1 part)(len 0)(b"").
    extra = struct.pack("<I", 1) + struct.pack("<I", 0)
    assert encode_extra_keys(b"", ()) == extra
    expected = hashlib.sha256(ROOT_HASH + extra + struct.pack("<4I", 1, 2, 3, 4)).digest()
    assert chain_block_hashes([1, 2, 3, 4], 4, encode_extra_keys())[0] == expected


def test_first_block_digest_is_stable_across_releases():
    # A literal pin: a change here silently invalidates every hash an older daemon
    # (or the gateway's routing table) has seen; bump ROOT_HASH's version instead.
    digest = chain_block_hashes([1, 2, 3, 4], 4, encode_extra_keys())[0]
    assert digest.hex() == "18b40c01efe565d39fe006b4d8ee5e5174826abedeeebf3fc51d48ae1d3df855"


def test_second_block_chains_on_the_first_digest():
    hashes = chain_block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4, NO_EXTRA)
    expected = hashlib.sha256(hashes[0] + NO_EXTRA + struct.pack("<4I", 5, 6, 7, 8)).digest()
    assert hashes[1] == expected


def test_token_bytes_is_little_endian_uint32():
    assert token_bytes([1, 0x01020304, MAX_TOKEN_ID]) == struct.pack("<3I", 1, 0x01020304, MAX_TOKEN_ID)


def test_extra_keys_encoding_is_length_prefixed():
    assert encode_extra_keys(b"salt", [b"k"]) == (
        struct.pack("<I", 2) + struct.pack("<I", 4) + b"salt" + struct.pack("<I", 1) + b"k"
    )


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ((b"ab", [b"c"]), (b"a", [b"bc"])),
        ((b"", [b"x"]), (b"x", [])),
        ((b"x", [b""]), (b"x", [])),
        ((b"", []), (b"", [b""])),
        ((b"a", [b"b", b"c"]), (b"a", [b"bc"])),
        ((b"a", [b"b", b"c"]), (b"a", [b"c", b"b"])),
    ],
)
def test_extra_keys_encoding_is_unambiguous(a, b):
    assert encode_extra_keys(*a) != encode_extra_keys(*b)


# ------------------------------------------------------------ chain property


@settings(max_examples=100, deadline=None)
@given(_tokens, st.binary(max_size=4))
def test_same_tokens_and_salt_give_the_same_hashes(tokens, salt):
    extra = encode_extra_keys(salt)
    assert chain_block_hashes(tokens, BS, extra) == chain_block_hashes(list(tokens), BS, encode_extra_keys(salt))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=3 * BS, max_size=6 * BS), st.data())
def test_changing_an_earlier_block_changes_every_later_hash(tokens, data):
    num_full = len(tokens) // BS
    block = data.draw(st.integers(0, num_full - 1), label="changed block")
    pos = data.draw(st.integers(block * BS, block * BS + BS - 1), label="changed position")
    changed = list(tokens)
    changed[pos] += 1
    before = chain_block_hashes(tokens, BS, NO_EXTRA)
    after = chain_block_hashes(changed, BS, NO_EXTRA)
    assert before[:block] == after[:block]
    for i in range(block, num_full):
        assert before[i] != after[i], f"block {i} kept its hash after block {block} changed"
    assert set(before[block:]).isdisjoint(after[block:])


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=BS, max_size=5 * BS))
def test_different_cache_salts_give_disjoint_hashes(tokens):
    a = chain_block_hashes(tokens, BS, encode_extra_keys(b"tenant-a"))
    b = chain_block_hashes(tokens, BS, encode_extra_keys(b"tenant-b"))
    plain = chain_block_hashes(tokens, BS, encode_extra_keys())
    assert len(a) == len(b) == len(plain) == len(tokens) // BS
    assert set(a).isdisjoint(b)
    assert set(a).isdisjoint(plain)
    assert set(b).isdisjoint(plain)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=BS, max_size=5 * BS))
def test_different_extra_keys_give_disjoint_hashes(tokens):
    a = chain_block_hashes(tokens, BS, encode_extra_keys(b"s", [b"lora-1"]))
    b = chain_block_hashes(tokens, BS, encode_extra_keys(b"s", [b"lora-2"]))
    none = chain_block_hashes(tokens, BS, encode_extra_keys(b"s"))
    assert set(a).isdisjoint(b)
    assert set(a).isdisjoint(none)


def test_only_full_blocks_are_hashed():
    assert chain_block_hashes([], BS, NO_EXTRA) == []
    assert chain_block_hashes([1, 2, 3], BS, NO_EXTRA) == []
    assert len(chain_block_hashes([1, 2, 3, 4], BS, NO_EXTRA)) == 1
    assert len(chain_block_hashes(list(range(11)), BS, NO_EXTRA)) == 2
    assert len(chain_block_hashes(list(range(12)), BS, NO_EXTRA)) == 3


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=4 * BS), st.lists(st.integers(0, 3), min_size=1, max_size=BS - 1))
def test_a_trailing_partial_block_is_ignored(tokens, tail):
    full = tokens[: len(tokens) // BS * BS]
    assert chain_block_hashes(full + tail, BS, NO_EXTRA) == chain_block_hashes(full, BS, NO_EXTRA)


def test_partial_block_tokens_are_not_validated_by_hashing():
    # Documents the division of labour: KVCacheManager.new_request validates the tail.
    assert chain_block_hashes([1, 2, 3, 4, -1], BS, NO_EXTRA) == chain_block_hashes([1, 2, 3, 4], BS, NO_EXTRA)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=6 * BS), st.data())
def test_continuing_from_a_parent_equals_hashing_all_at_once(tokens, data):
    extra = encode_extra_keys(b"salt", [b"k"])
    whole = chain_block_hashes(tokens, BS, extra)
    start = data.draw(st.integers(0, len(whole)), label="start_block")
    parent = whole[start - 1] if start else ROOT_HASH
    assert chain_block_hashes(tokens, BS, extra, parent=parent, start_block=start) == whole[start:]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, MAX_TOKEN_ID), max_size=6 * BS), st.data())
def test_hashing_packed_ids_between_two_blocks_equals_the_chain(tokens, data):
    # The daemon keeps a request's ids packed and hashes blocks as they fill
    # (hash_blocks); the gateway hashes lists (chain_block_hashes): one identity.
    extra = encode_extra_keys(b"salt")
    whole = chain_block_hashes(tokens, BS, extra)
    packed = pack_tokens(tokens)
    assert hash_blocks(packed, BS, extra) == whole
    start = data.draw(st.integers(0, len(whole)), label="start_block")
    end = data.draw(st.integers(start, len(whole) + 2), label="end_block")
    parent = whole[start - 1] if start else ROOT_HASH
    assert hash_blocks(packed, BS, extra, parent, start, end) == whole[start:end]


def test_packed_ids_are_checked_once_and_compact():
    packed = pack_tokens([0, 5, MAX_TOKEN_ID])
    assert list(packed) == [0, 5, MAX_TOKEN_ID] and packed.itemsize == 4
    with pytest.raises(ValueError, match="token ids"):
        pack_tokens([1, -1])


def test_start_block_past_the_full_blocks_hashes_nothing():
    tokens = list(range(9))
    whole = chain_block_hashes(tokens, BS, NO_EXTRA)
    assert chain_block_hashes(tokens, BS, NO_EXTRA, parent=whole[-1], start_block=2) == []
    assert chain_block_hashes(tokens, BS, NO_EXTRA, parent=whole[-1], start_block=5) == []


def test_block_size_changes_the_hashes():
    tokens = list(range(8))
    assert chain_block_hashes(tokens, 4, NO_EXTRA)[1] != chain_block_hashes(tokens, 8, NO_EXTRA)[0]


# ----------------------------------------------------------------- bad input


@pytest.mark.parametrize("bad", [-1, 2**32, 2**64, 1.0, 2.5, "7", None, b"x"], ids=repr)
def test_bad_token_ids_in_a_full_block_raise_value_error(bad):
    with pytest.raises(ValueError, match="token ids"):
        chain_block_hashes([1, 2, bad, 4], BS, NO_EXTRA)
    with pytest.raises(ValueError, match="token ids"):
        token_bytes([bad])


def test_boundary_token_ids_are_accepted():
    assert len(chain_block_hashes([0, MAX_TOKEN_ID, 0, MAX_TOKEN_ID], BS, NO_EXTRA)) == 1


def test_a_bytes_token_sequence_hashes_like_the_list_of_its_values():
    tokens = bytes(range(8))
    assert chain_block_hashes(tokens, BS, NO_EXTRA) == chain_block_hashes(list(tokens), BS, NO_EXTRA)
