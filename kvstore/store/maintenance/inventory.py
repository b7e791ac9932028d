"""What is in a store, for tools: open an existing store, list namespaces, blocks and
prompts, find a block by its key.

These read the index (:mod:`kvstore.store.blocks.index`) without touching records,
except :func:`find_block`, which only checks the record is there. Tools open
stores with :func:`open_existing`, which never creates one: inspecting a
mistyped path must say so, not leave an empty store behind.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

from kvstore.abc.store import PrefixStore
from kvstore.codecs.record import verify_record
from kvstore.errors import CapabilityError, StoreConfigError
from kvstore.store import BACKEND_OPTIONS, _split_url, open_store
from kvstore.store import keys as K
from kvstore.store.blocks.index import decode_entry, iter_entries, read_use
from kvstore.store.maintenance.transfer import StoredBlock, namespaces_of

__all__ = [
    "BlockInfo",
    "PromptInfo",
    "store_scheme",
    "lmdb_path",
    "open_existing",
    "require_namespace",
    "give_back_space",
    "list_blocks",
    "list_prompts",
    "find_block",
]

_KEY_TEXT = re.compile(
    r"(?:kvstore/v1/)?(?:(?P<ns>[a-z0-9][a-z0-9-]{0,31})/)?(?P<hex>[0-9a-f]{4,64})"
)


@dataclass(frozen=True)
class BlockInfo:
    """One stored block as the index describes it.

    Attributes:
        key: the record key (``kvstore/v1/<namespace>/<hash>``).
        index: position in its chain (block ``i`` holds tokens from ``i * block_size``).
        tokens: tokens the block holds (``block_size``, or fewer for a tail).
        full: False for a prompt's partial last block (a tail).
        leaf: nothing is stored after it (the end of a stored prompt).
    """

    namespace: str
    key: str
    digest: str
    parent: str | None
    index: int
    start: int
    tokens: int
    bytes: int
    family: str
    full: bool
    created: float
    last_use: float | None
    leaf: bool


@dataclass(frozen=True)
class PromptInfo:
    """A stored prompt: the chain from a first block to a leaf."""

    namespace: str
    tokens: int
    blocks: int
    bytes: int
    leaf_key: str
    last_use: float | None


def store_scheme(url: str) -> str:
    """The backend scheme of ``url`` (``lmdb`` for a bare path; ``tiered``)."""
    if url == "tiered" or url.lower().startswith("tiered:"):
        return "tiered"
    return _split_url(url)[0]


def lmdb_path(url: str) -> str | None:
    """The directory of an LMDB store URL (``None`` for other schemes)."""
    if store_scheme(url) != "lmdb":
        return None
    return os.path.expanduser(_split_url(url)[1])


def open_existing(
    url: str, *, writable: bool = False, operation: str = "open", **options: Any
) -> PrefixStore:
    """Open the store at ``url``, which must exist; never creates one.

    Opened read-only unless ``writable`` (where the backend has a read-only
    mode: LMDB, Redis), with records checked by
    :func:`~kvstore.codecs.record.verify_record` and no background writer.

    Raises:
        StoreConfigError: nothing at ``url`` is a store (missing directory,
            a file, a foreign directory or database), a bad URL or scheme.
        FormatVersionError: the store was written by a newer kvstore.
    """
    scheme = store_scheme(url)
    options = {"verify": verify_record, "touch_interval": 0, **options}
    path = lmdb_path(url)
    if path is not None and not os.path.exists(path):
        raise StoreConfigError(
            f"[{operation}] No store at {path}: the directory does not exist. Check the path "
            f"or URL (a store is created by saving into it, not by inspecting it).",
            path=path,
        )
    backend_options = BACKEND_OPTIONS.get(scheme, {})
    if "create" in backend_options:
        options.setdefault("create", False)
    elif writable and "readonly" in backend_options:
        # No create option (Redis): a read-only open first refuses a location with no store.
        open_store(url, **{**options, "readonly": True}).close()
    if "readonly" in backend_options:
        options.setdefault("readonly", not writable)
    return open_store(url, **options)


def require_namespace(store: PrefixStore, namespace: str, operation: str) -> bytes:
    """``namespace`` as key bytes, after checking that ``store`` holds blocks in it.

    Raises:
        StoreConfigError: a malformed namespace, or one the store does not hold;
            the message lists the namespaces it holds.
    """
    ns = K.parse_namespace(namespace)
    held = namespaces_of(store.backend)
    if ns not in held:
        names = ", ".join(sorted(n.decode() for n in held)) or "none"
        raise StoreConfigError(
            f"[{operation}] The store {store.url} has no namespace {namespace!r} (it holds: "
            f"{names}). Run 'kvstore ls {store.url}' to list them.",
            found=namespace,
            supported=sorted(n.decode() for n in held),
        )
    return ns


def give_back_space(store: PrefixStore) -> int:
    """The room freed values leave at the end of the store's files, given back to the
    filesystem now rather than at its next write (:meth:`Backend.give_back_space`): the
    bytes; 0 for a composite store, whose tiers give theirs back as they write."""
    try:
        backend = store.backend
    except CapabilityError:
        return 0
    return backend.give_back_space()


def list_blocks(store: PrefixStore, namespace: bytes) -> list[BlockInfo]:
    """Every block of ``namespace``, in chain order (by position, then key)."""
    bsize = store.block_size
    rows: list[tuple[bytes, Any, float | None]] = []
    with store.backend.reader() as view:
        for sub in (b".c/", b".t/"):
            for key, entry in iter_entries(
                view, K.namespace_dir(namespace) + sub, with_tokens=False
            ):
                use = view.get(K.use_key(namespace, entry.digest))
                found = read_use(use)
                rows.append((key, entry, None if found is None else found[0]))
    parents = {entry.parent for _, entry, _ in rows}
    ns = namespace.decode()
    out = [
        BlockInfo(
            namespace=ns,
            key=K.record_key(namespace, e.digest).decode(),
            digest=e.digest.hex(),
            parent=None if e.parent == K.ROOT else e.parent.hex(),
            index=e.depth,
            start=e.depth * bsize,
            tokens=e.ntokens,
            bytes=e.nbytes,
            family=e.family,
            full=e.full,
            created=e.created,
            last_use=last,
            leaf=e.digest not in parents,
        )
        for _, e, last in rows
    ]
    return sorted(out, key=lambda b: (b.index, b.key))


def list_prompts(blocks: list[BlockInfo]) -> list[PromptInfo]:
    """The stored prompts among ``blocks`` (one namespace): one per leaf, longest first."""
    by_digest = {b.digest: b for b in blocks}
    prompts: list[PromptInfo] = []
    for leaf in (b for b in blocks if b.leaf):
        nbytes, count = 0, 0
        node: BlockInfo | None = leaf
        while node is not None:
            nbytes, count = nbytes + node.bytes, count + 1
            node = by_digest.get(node.parent) if node.parent else None
        prompts.append(
            PromptInfo(
                leaf.namespace, leaf.start + leaf.tokens, count, nbytes, leaf.key, leaf.last_use
            )
        )
    return sorted(prompts, key=lambda p: (-p.tokens, p.leaf_key))


def find_block(store: PrefixStore, text: str, operation: str = "inspect") -> StoredBlock:
    """The block named by ``text``: a record key (``kvstore/v1/<ns>/<hash>``),
    ``<ns>/<hash>``, or a hash (or a unique prefix of at least 4 hex digits).

    Raises:
        StoreConfigError: ``text`` names no block of the store, or several.
    """
    m = _KEY_TEXT.fullmatch(text.strip().lower())
    if m is None:
        raise StoreConfigError(
            f"[{operation}] {text!r} is not a block key. Give kvstore/v1/<namespace>/<hash>, "
            f"<namespace>/<hash> or a hash prefix (kvstore ls URL --namespace N lists them).",
            found=text,
        )
    spaces = [m["ns"].encode()] if m["ns"] else sorted(namespaces_of(store.backend))
    found: list[bytes] = []
    with store.backend.reader() as view:
        for ns in spaces:
            found += [
                k
                for k in view.keys(K.namespace_dir(ns) + m["hex"].encode())
                if K.split_record_key(k)
            ]
        if len(found) != 1:
            what = "no block" if not found else f"{len(found)} blocks"
            raise StoreConfigError(
                f"[{operation}] {text!r} matches {what} in {store.url}. Run 'kvstore ls "
                f"{store.url} --namespace N' to list block keys"
                + (", and give more of the hash." if found else "."),
                found=text,
                matches=[k.decode() for k in found],
            )
        ns, digest = K.split_record_key(found[0])  # type: ignore[misc]
        use = view.get(K.use_key(ns, digest))
        found_use = read_use(use)
        index_key = None if found_use is None else found_use[1]
        raw = None if index_key is None else view.get(index_key)
        if raw is None:  # no last use: look for the entry in the index itself
            for sub in (b".c/", b".t/"):
                for key, entry in iter_entries(view, K.namespace_dir(ns) + sub, with_tokens=False):
                    if entry.digest == digest:
                        index_key, raw = key, view.get(key)
        if raw is None or index_key is None:
            raise StoreConfigError(
                f"[{operation}] {found[0].decode()} has a record but no index entry (a dangling "
                f"record). Run 'kvstore verify {store.url} --fix'.",
                found=found[0].decode(),
            )
        return StoredBlock(ns, index_key, decode_entry(raw))
