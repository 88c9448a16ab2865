"""Block hashes: the prefix property, the exact byte encoding, and input validation."""

from __future__ import annotations

import hashlib
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvd.common.hashing import (
    DOMAIN,
    MAX_TOKEN_ID,
    BlockHasher,
    encode_extra_keys,
    hash_token_ids,
    pack_tokens,
)

BS = 4
NO_EXTRA = encode_extra_keys()

_tokens = st.lists(st.integers(0, MAX_TOKEN_ID), min_size=0, max_size=6 * BS)


# ------------------------------------------------------------- encoding pins


def test_the_domain_is_versioned():
    assert DOMAIN == b"kvd/block-hash/v2"


def test_first_block_digest_matches_the_documented_byte_encoding():
    # sha256(DOMAIN ‖ block size ‖ extra ‖ tokens), uint32-le, with extra = (1 part)(len 0)(b"").
    extra = struct.pack("<I", 1) + struct.pack("<I", 0)
    assert encode_extra_keys(b"", ()) == extra
    expected = hashlib.sha256(DOMAIN + struct.pack("<I", 4) + extra + struct.pack("<4I", 1, 2, 3, 4)).digest()
    assert hash_token_ids([1, 2, 3, 4], 4, encode_extra_keys())[0] == expected


def test_first_block_digest_is_stable_across_releases():
    # A literal pin: a change here silently invalidates every hash an older daemon
    # (or the gateway's routing table) has seen; bump DOMAIN's version instead.
    digest = hash_token_ids([1, 2, 3, 4], 4, encode_extra_keys())[0]
    assert digest.hex() == "f8745ed72819eeccb3ef56a06cdecc42c5ab32070a2d6e446644fa2569840673"


def test_block_i_hashes_everything_up_to_its_end():
    hashes = hash_token_ids([1, 2, 3, 4, 5, 6, 7, 8], 4, NO_EXTRA)
    expected = hashlib.sha256(
        DOMAIN + struct.pack("<I", 4) + NO_EXTRA + struct.pack("<8I", 1, 2, 3, 4, 5, 6, 7, 8)
    ).digest()
    assert hashes[1] == expected


def test_token_ids_are_hashed_as_little_endian_uint32():
    tokens = [1, 0x01020304, MAX_TOKEN_ID, 0]
    expected = hashlib.sha256(DOMAIN + struct.pack("<I", 4) + NO_EXTRA + struct.pack("<4I", *tokens)).digest()
    assert hash_token_ids(tokens, 4, NO_EXTRA) == [expected]


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


# ----------------------------------------------------------- prefix property


@settings(max_examples=100, deadline=None)
@given(_tokens, st.binary(max_size=4))
def test_same_tokens_and_salt_give_the_same_hashes(tokens, salt):
    extra = encode_extra_keys(salt)
    assert hash_token_ids(tokens, BS, extra) == hash_token_ids(list(tokens), BS, encode_extra_keys(salt))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=3 * BS, max_size=6 * BS), st.data())
def test_changing_an_earlier_block_changes_every_later_hash(tokens, data):
    num_full = len(tokens) // BS
    block = data.draw(st.integers(0, num_full - 1), label="changed block")
    pos = data.draw(st.integers(block * BS, block * BS + BS - 1), label="changed position")
    changed = list(tokens)
    changed[pos] += 1
    before = hash_token_ids(tokens, BS, NO_EXTRA)
    after = hash_token_ids(changed, BS, NO_EXTRA)
    assert before[:block] == after[:block]
    for i in range(block, num_full):
        assert before[i] != after[i], f"block {i} kept its hash after block {block} changed"
    assert set(before[block:]).isdisjoint(after[block:])


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=BS, max_size=5 * BS))
def test_different_cache_salts_give_disjoint_hashes(tokens):
    a = hash_token_ids(tokens, BS, encode_extra_keys(b"tenant-a"))
    b = hash_token_ids(tokens, BS, encode_extra_keys(b"tenant-b"))
    plain = hash_token_ids(tokens, BS, encode_extra_keys())
    assert len(a) == len(b) == len(plain) == len(tokens) // BS
    assert set(a).isdisjoint(b)
    assert set(a).isdisjoint(plain)
    assert set(b).isdisjoint(plain)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=BS, max_size=5 * BS))
def test_different_extra_keys_give_disjoint_hashes(tokens):
    a = hash_token_ids(tokens, BS, encode_extra_keys(b"s", [b"lora-1"]))
    b = hash_token_ids(tokens, BS, encode_extra_keys(b"s", [b"lora-2"]))
    none = hash_token_ids(tokens, BS, encode_extra_keys(b"s"))
    assert set(a).isdisjoint(b)
    assert set(a).isdisjoint(none)


def test_only_full_blocks_are_hashed():
    assert hash_token_ids([], BS, NO_EXTRA) == []
    assert hash_token_ids([1, 2, 3], BS, NO_EXTRA) == []
    assert len(hash_token_ids([1, 2, 3, 4], BS, NO_EXTRA)) == 1
    assert len(hash_token_ids(list(range(11)), BS, NO_EXTRA)) == 2
    assert len(hash_token_ids(list(range(12)), BS, NO_EXTRA)) == 3


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=4 * BS), st.lists(st.integers(0, 3), min_size=1, max_size=BS - 1))
def test_a_trailing_partial_block_is_ignored(tokens, tail):
    full = tokens[: len(tokens) // BS * BS]
    assert hash_token_ids(full + tail, BS, NO_EXTRA) == hash_token_ids(full, BS, NO_EXTRA)


def test_partial_block_tokens_are_not_validated_by_hashing():
    # Documents the division of labour: KVCacheManager.new_request validates the tail.
    assert hash_token_ids([1, 2, 3, 4, -1], BS, NO_EXTRA) == hash_token_ids([1, 2, 3, 4], BS, NO_EXTRA)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, MAX_TOKEN_ID), max_size=6 * BS), st.lists(st.integers(0, 8), max_size=4))
def test_a_hasher_advanced_in_steps_equals_hashing_all_at_once(tokens, stops):
    # The daemon keeps a request's ids packed and hashes blocks as they fill
    # (BlockHasher.advance, from wherever it stopped); the gateway hashes
    # lists (hash_token_ids): one identity.
    extra = encode_extra_keys(b"salt", [b"k"])
    whole = hash_token_ids(tokens, BS, extra)
    packed = pack_tokens(tokens)
    hasher = BlockHasher(extra, BS)
    got: list[bytes] = []
    for stop in [*sorted(stops), None]:
        before = hasher.num_blocks
        new = hasher.advance(packed, stop)
        got += new
        assert hasher.num_blocks == before + len(new) == len(got)
    assert got == whole


def test_a_hasher_hashes_blocks_as_the_sequence_grows():
    extra = encode_extra_keys()
    hasher = BlockHasher(extra, BS)
    packed = pack_tokens([1, 2, 3])
    assert hasher.advance(packed) == [] and hasher.num_blocks == 0
    packed.extend([4, 5, 6, 7, 8, 9])
    assert hasher.advance(packed) == hash_token_ids(list(packed), BS, extra)
    assert hasher.num_blocks == 2 and hasher.advance(packed) == []


def test_packed_ids_are_checked_once_and_compact():
    packed = pack_tokens([0, 5, MAX_TOKEN_ID])
    assert list(packed) == [0, 5, MAX_TOKEN_ID] and packed.itemsize == 4
    with pytest.raises(ValueError, match="token ids"):
        pack_tokens([1, -1])


def test_block_size_changes_the_hashes():
    tokens = list(range(8))
    assert hash_token_ids(tokens, 4, NO_EXTRA)[1] != hash_token_ids(tokens, 8, NO_EXTRA)[0]


# ----------------------------------------------------------------- bad input


@pytest.mark.parametrize("bad", [-1, 2**32, 2**64, 1.0, 2.5, "7", None, b"x"], ids=repr)
def test_bad_token_ids_in_a_full_block_raise_value_error(bad):
    with pytest.raises(ValueError, match="token ids"):
        hash_token_ids([1, 2, bad, 4], BS, NO_EXTRA)
    with pytest.raises(ValueError, match="token ids"):
        pack_tokens([bad])


def test_boundary_token_ids_are_accepted():
    assert len(hash_token_ids([0, MAX_TOKEN_ID, 0, MAX_TOKEN_ID], BS, NO_EXTRA)) == 1


def test_a_bytes_token_sequence_hashes_like_the_list_of_its_values():
    tokens = bytes(range(8))
    assert hash_token_ids(tokens, BS, NO_EXTRA) == hash_token_ids(list(tokens), BS, NO_EXTRA)
