"""Key derivation: frozen vectors, canonical token bytes, the chained hash, order keys."""

from __future__ import annotations

import hashlib
import struct

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstore.errors import CapabilityError, StoreConfigError
from kvstore.store import keys as K

NS = b"0123456789abcdef"

# Frozen: these are the keys every kvstore v1 writer derives. Changing the
# derivation orphans every stored block; it takes a new schema version.
VECTORS = [
    "207230f80e356f02e56ecc33c5e337c7c179e3a7d81d5a3e93ca2478c17db2ce",
    "fee3b17d0b890f75099ba2eeb9f34cf27abf274fe0bdeb3a55ad95cd2c4a0728",
]
TAIL_VECTOR = "5c3422481aee62fc7350083a8df94595848aec1e7e93fc1a7fc9023d76d00bba"
EDGE_VECTOR = "773cebaac173d760b55b6f46c56cb494531aa72e890bd516505c279c14b835e7"


def naive_chain(ns: bytes, tokens: list[int], block_size: int) -> list[bytes]:
    """The definition, written out: H(parent || namespace || tokens as LE u32), chained."""
    out, parent = [], bytes(32)
    for i in range(len(tokens) // block_size):
        block = tokens[i * block_size : (i + 1) * block_size]
        data = parent + ns + struct.pack(f"<{len(block)}I", *block)
        parent = hashlib.blake2b(data, digest_size=32, person=b"kvstore-block/v1").digest()
        out.append(parent)
    return out


def test_frozen_vectors():
    tokens = K.as_tokens(list(range(10)))
    digests = K.chain_digests(NS, tokens, 4)
    assert [d.hex() for d in digests] == VECTORS
    assert K.block_digest(digests[-1], NS, tokens[8:]).hex() == TAIL_VECTOR
    edge = np.array([0, 1, K.MAX_TOKEN], dtype="<u4")
    assert K.block_digest(K.ROOT, b"ns", edge).hex() == EDGE_VECTOR
    assert K.record_key(NS, digests[0]) == b"kvstore/v1/0123456789abcdef/" + VECTORS[0].encode()


def test_vectors_match_the_written_out_definition():
    assert [d.hex() for d in naive_chain(NS, list(range(10)), 4)] == VECTORS


@given(st.lists(st.integers(0, K.MAX_TOKEN), max_size=70), st.integers(1, 9))
def test_vectorised_chain_equals_the_definition(tokens, block_size):
    got = K.chain_digests(NS, K.as_tokens(tokens), block_size)
    assert got == naive_chain(NS, tokens, block_size)
    assert list(K.iter_chain_digests(NS, K.as_tokens(tokens), block_size)) == got


@pytest.mark.parametrize(
    "convert",
    [
        list,
        tuple,
        lambda t: np.array(t, dtype=np.int64),
        lambda t: np.array(t, dtype=">u4"),
        lambda t: np.array(t, dtype=np.uint16),
        lambda t: mx.array(t, dtype=mx.int32),
        lambda t: np.array(t, dtype=np.int64)[::-1][::-1],  # a non-contiguous view
    ],
    ids=["list", "tuple", "int64", "big-endian", "uint16", "mlx", "strided"],
)
def test_every_integer_input_gives_the_same_keys(convert):
    tokens = [5, 1000, 65535, 7, 3, 2, 1, 0, 42]
    assert K.chain_digests(NS, K.as_tokens(convert(tokens)), 4) == naive_chain(NS, tokens, 4)


def test_the_chain_names_the_whole_prefix():
    a = K.chain_digests(NS, K.as_tokens(list(range(12))), 4)
    b = K.chain_digests(NS, K.as_tokens([99, *range(1, 12)]), 4)
    assert all(
        x != y for x, y in zip(a, b, strict=True)
    )  # one changed token changes every later key
    c = K.chain_digests(b"other-namespace", K.as_tokens(list(range(12))), 4)
    assert not set(a) & set(c)


@pytest.mark.parametrize(
    "bad, fragment",
    [
        ([1, -1], "OverflowError"),
        ([2**32 - 1], str(2**32 - 1)),
        (np.array([7, 2**32 - 1, 9], dtype="<u4"), str(2**32 - 1)),
        ([1.5], "TypeError"),
        (["a"], "TypeError"),
        (np.array([[1, 2]]), "shape (1, 2)"),
        (np.array([0.5]), "dtype float64"),
        (np.array([-3, 4]), "ids from -3 to 4"),
    ],
)
def test_bad_tokens_are_rejected_with_the_reason(bad, fragment):
    with pytest.raises(CapabilityError, match=r"\[lookup\] Token ids must be") as info:
        K.as_tokens(bad, "lookup")
    assert fragment in str(info.value)


@pytest.mark.parametrize("name", ["", "UPPER", "-dash", "a/b", "x" * 33, "__meta__", 7])
def test_bad_namespaces(name):
    with pytest.raises(StoreConfigError, match="namespace_for"):
        K.parse_namespace(name)


def test_good_namespace():
    assert K.parse_namespace("0f3a-tenant") == b"0f3a-tenant"


def token_lists():
    return st.lists(st.integers(0, 5), min_size=1, max_size=K.ORDER_TOKENS + 3)


@given(token_lists(), token_lists())
def test_order_keys_sort_like_token_tuples(a, b):
    ka = K.order_prefix(np.array(a, dtype="<u4"), pad=True)
    kb = K.order_prefix(np.array(b, dtype="<u4"), pad=True)
    ta, tb = tuple(a[: K.ORDER_TOKENS]), tuple(b[: K.ORDER_TOKENS])
    assert (ka < kb) == (ta < tb) and (ka == kb) == (ta == tb)


def test_longest_index_key_fits_lmdb():
    ns = b"n" * 32
    key = K.child_key(ns, K.ROOT, np.arange(256, dtype="<u4"), bytes(32), True)
    assert len(key) <= 511


@given(st.binary(min_size=1, max_size=8), st.binary(max_size=8))
def test_prefix_successor_bounds_the_prefix(prefix, rest):
    succ = K.prefix_successor(prefix)
    assert prefix + rest < succ
    assert prefix <= succ
