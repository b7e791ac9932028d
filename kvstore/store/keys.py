"""Key derivation and the key layout of a prefix store (schema ``kvstore/v1``).

Block hashes are chained: block ``i`` of a prompt is named by

    digest_i = BLAKE2b-256(digest_{i-1} || namespace || tokens_i as little-endian u32,
                           person=b"kvstore-block/v1")

with ``digest_{-1}`` = 32 zero bytes (:data:`ROOT`). A digest therefore names
the block's whole prefix, in that namespace. Tokens are hashed as canonical
bytes (little-endian u32 whatever dtype arrived), never with Python's
``hash()``, so every process and host derives the same keys. The frozen
vectors in ``tests/test_store/test_keys.py`` pin this down.

Layout (``<ns>`` a namespace, ``<h>`` a digest in hex)::

    kvstore/v1/__meta__                    store settings (:mod:`kvstore.store.settings`)
    kvstore/v1/!meta                       their copy, sorted first: another B-tree page
    kvstore/v1/__ns__/<ns>                 namespace totals: blocks, bytes
    kvstore/v1/<ns>/<h>                    the block's record (opaque bytes)
    kvstore/v1/<ns>/.c/<parent h>/<order>  index entry of a full child block
    kvstore/v1/<ns>/.t/<parent h>/<order>  index entry of a partial tail block
    kvstore/v1/<ns>/.u/<h>                 last use (recency for eviction)

``<order>`` is the child's first :data:`ORDER_TOKENS` tokens as big-endian
``token + 1`` words, zero-padded to a fixed width, then 16 bytes of its
digest: byte order is then the lexicographic order of token sequences, so a
lookup finds the child sharing the longest prefix with the prompt by one seek
(the best match of a sorted set is next to where the query would sit).
"""

from __future__ import annotations

import array
import functools
import hashlib
import re
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np

from kvstore.errors import CapabilityError, StoreConfigError

__all__ = [
    "SCHEMA",
    "ROOT",
    "DIGEST_SIZE",
    "MAX_TOKEN",
    "ORDER_TOKENS",
    "META_KEY",
    "META_COPY_KEY",
    "META_KEYS",
    "NS_TOTALS_DIR",
    "as_tokens",
    "parse_namespace",
    "is_namespace",
    "block_digest",
    "chain_digests",
    "iter_chain_digests",
    "record_key",
    "split_record_key",
    "namespace_dir",
    "children_dir",
    "tails_dir",
    "child_key",
    "split_child_key",
    "order_prefix",
    "use_key",
    "totals_key",
    "prefix_successor",
]

SCHEMA = b"kvstore/v1/"
META_KEY = SCHEMA + b"__meta__"
#: The settings record's copy. ``!`` sorts before every namespace (and ``__meta__``
#: after digits), so in LMDB the two lie on different pages of any but a tiny store.
META_COPY_KEY = SCHEMA + b"!meta"
META_KEYS = (META_KEY, META_COPY_KEY)
NS_TOTALS_DIR = SCHEMA + b"__ns__/"
DIGEST_SIZE = 32
ROOT = bytes(DIGEST_SIZE)
_PERSON = b"kvstore-block/v1"  # 16 bytes: BLAKE2b's personalisation domain-separates us
#: Largest token id (order keys store ``token + 1`` in a u32).
MAX_TOKEN = 2**32 - 2
#: Tokens of a child that its order key carries (LMDB keys are at most 511 bytes).
ORDER_TOKENS = 88
_ORDER_DIGEST = 16
_NAMESPACE = re.compile(r"[a-z0-9][a-z0-9-]{0,31}")
_LITTLE = sys.byteorder == "little"


def as_tokens(tokens: Any, operation: str = "tokens") -> np.ndarray:
    """``tokens`` as a C-contiguous little-endian ``uint32`` array (no copy when it is one).

    Accepts a list/tuple/range of ints, or a 1-D integer array (numpy, MLX).

    Raises:
        CapabilityError: not a 1-D integer sequence, or an id outside ``[0, MAX_TOKEN]``.
    """
    if isinstance(tokens, np.ndarray) and tokens.dtype == np.dtype("<u4"):
        arr = np.ascontiguousarray(tokens)
    elif isinstance(tokens, (list, tuple, range)):
        # array('I') converts a list of ints ~3x faster than numpy and rejects
        # negatives, floats and oversized ids by itself.
        try:
            words = array.array("I", tokens)
        except (OverflowError, TypeError) as exc:
            raise _bad_tokens(operation, f"{type(exc).__name__}: {exc}") from exc
        arr = np.frombuffer(words, dtype=np.uint32) if words.itemsize == 4 else np.asarray(words)
        if not _LITTLE or words.itemsize != 4:
            arr = arr.astype("<u4")
    else:
        try:
            raw = np.asarray(tokens)
        except Exception as exc:  # noqa: BLE001 - any conversion failure is bad input
            raise _bad_tokens(operation, f"{type(tokens).__name__}") from exc
        if raw.dtype.kind not in "ui" or raw.ndim != 1:
            raise _bad_tokens(operation, f"array of dtype {raw.dtype} and shape {raw.shape}")
        if raw.size and (int(raw.min()) < 0 or int(raw.max()) > MAX_TOKEN):
            raise _bad_tokens(operation, f"ids from {int(raw.min())} to {int(raw.max())}")
        return np.ascontiguousarray(raw, dtype="<u4")
    if arr.ndim != 1:
        raise _bad_tokens(operation, f"shape {arr.shape}")
    if arr.size and int(arr.max()) > MAX_TOKEN:
        raise _bad_tokens(operation, f"id {int(arr.max())}")
    return arr


def _bad_tokens(operation: str, received: str) -> CapabilityError:
    return CapabilityError(
        f"[{operation}] Token ids must be a 1-D sequence of integers in [0, {MAX_TOKEN}]; "
        f"received {received}. Pass the prompt's token ids (a list or an integer array).",
        found=received,
    )


def parse_namespace(namespace: object) -> bytes:
    """Validate a namespace (``namespace_for`` makes them) and return it as key bytes.

    Raises:
        StoreConfigError: not 1-32 characters of ``[a-z0-9-]`` starting alphanumeric.
    """
    if not isinstance(namespace, str) or not _is_namespace_text(namespace):
        raise StoreConfigError(
            f"[namespace] A namespace is 1-32 characters of [a-z0-9-], starting with a letter "
            f"or digit; received {namespace!r}. Use kvstore.store.namespace_for(...).",
            found=namespace,
        )
    return namespace.encode("ascii")


@functools.lru_cache(maxsize=256)
def _is_namespace_text(namespace: str) -> bool:
    # Every save and lookup asks this of the same few namespaces: a dict hit is cheaper
    # than the regex engine, most of all on the first call after a forward pass.
    return _NAMESPACE.fullmatch(namespace) is not None


def is_namespace(raw: bytes) -> bool:
    """Whether ``raw`` (read from a key) is a namespace: a damaged key's may not be."""
    return _NAMESPACE.fullmatch(raw.decode("ascii", "replace")) is not None


def block_digest(parent: bytes, namespace: bytes, tokens_le: Any) -> bytes:
    """The digest of one block: H(parent digest || namespace || tokens as LE u32)."""
    h = hashlib.blake2b(parent, digest_size=DIGEST_SIZE, person=_PERSON)
    h.update(namespace)
    h.update(tokens_le)
    return h.digest()


def iter_chain_digests(
    namespace: bytes, tokens: np.ndarray, block_size: int, count: int | None = None
) -> Iterator[bytes]:
    """Digests of the first ``count`` full blocks of ``tokens`` (default: all), lazily.

    Each block is hashed from a memoryview slice of the one token buffer, so a
    32k-token prompt costs 128 hash calls and no copies.
    """
    n = len(tokens) // block_size if count is None else count
    raw = tokens.data.cast("B")
    step = 4 * block_size
    parent = ROOT
    blake = hashlib.blake2b
    for i in range(n):
        h = blake(parent, digest_size=DIGEST_SIZE, person=_PERSON)
        h.update(namespace)
        h.update(raw[i * step : (i + 1) * step])
        parent = h.digest()
        yield parent


def chain_digests(
    namespace: bytes, tokens: np.ndarray, block_size: int, count: int | None = None
) -> list[bytes]:
    """:func:`iter_chain_digests` as a list."""
    return list(iter_chain_digests(namespace, tokens, block_size, count))


def record_key(namespace: bytes, digest: bytes) -> bytes:
    return SCHEMA + namespace + b"/" + digest.hex().encode("ascii")


def split_record_key(key: bytes) -> tuple[bytes, bytes] | None:
    """``(namespace, digest)`` if ``key`` is a record key, else ``None``."""
    if not key.startswith(SCHEMA):
        return None
    ns, sep, tail = key[len(SCHEMA) :].partition(b"/")
    if not sep or len(tail) != 2 * DIGEST_SIZE or tail.startswith(b"."):
        return None
    try:
        return ns, bytes.fromhex(tail.decode("ascii"))
    except ValueError:
        return None


def namespace_dir(namespace: bytes) -> bytes:
    return SCHEMA + namespace + b"/"


def children_dir(namespace: bytes, parent: bytes) -> bytes:
    return SCHEMA + namespace + b"/.c/" + parent.hex().encode("ascii") + b"/"


def tails_dir(namespace: bytes, parent: bytes) -> bytes:
    return SCHEMA + namespace + b"/.t/" + parent.hex().encode("ascii") + b"/"


def order_prefix(tokens: np.ndarray, pad: bool) -> bytes:
    """The order bytes of ``tokens[:ORDER_TOKENS]``: big-endian ``token + 1`` words,
    zero-padded to the fixed width when ``pad`` (zero sorts before every token)."""
    out = (tokens[:ORDER_TOKENS] + np.uint32(1)).astype(">u4").tobytes()
    return out + bytes(4 * ORDER_TOKENS - len(out)) if pad else out


def child_key(
    namespace: bytes, parent: bytes, tokens: np.ndarray, digest: bytes, full: bool
) -> bytes:
    """The index key of a block under its parent (``.c`` for full blocks, ``.t`` for tails)."""
    base = children_dir if full else tails_dir
    return base(namespace, parent) + order_prefix(tokens, pad=True) + digest[:_ORDER_DIGEST]


def split_child_key(key: bytes) -> tuple[bytes, bool, bytes, bytes, bytes] | None:
    """``(namespace, full, parent digest hex, order bytes, digest prefix)`` of an index
    key (:func:`child_key`), or ``None`` if ``key`` is not one."""
    if not key.startswith(SCHEMA):
        return None
    ns, _, rest = key[len(SCHEMA) :].partition(b"/")
    kind, _, rest = rest.partition(b"/")
    parent, sep, order = rest.partition(b"/")
    if kind not in (b".c", b".t") or not sep or len(order) <= _ORDER_DIGEST:
        return None
    return ns, kind == b".c", parent, order[:-_ORDER_DIGEST], order[-_ORDER_DIGEST:]


def use_key(namespace: bytes, digest: bytes) -> bytes:
    return SCHEMA + namespace + b"/.u/" + digest.hex().encode("ascii")


def totals_key(namespace: bytes) -> bytes:
    return NS_TOTALS_DIR + namespace


def prefix_successor(prefix: bytes) -> bytes:
    """The smallest key greater than every key starting with ``prefix``."""
    stripped = prefix.rstrip(b"\xff")
    if not stripped:
        return b"\xff" * 512  # longer than any LMDB key
    return stripped[:-1] + bytes([stripped[-1] + 1])
