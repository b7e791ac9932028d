"""Model fingerprints and namespaces: the same model gets the same keys everywhere.

``model_fingerprint(obj)`` identifies a model by content:

* a model **directory** (mlx-lm layout): ``config.json`` (canonical JSON), the
  tokenizer files present, and the *content* of every weight file
  (``*.safetensors``, ``*.npz``, ``*.gguf``). A config-only fingerprint would
  give every fine-tune of an architecture the same namespace.
* an **mlx-lm model object**: its ``args`` (canonical JSON) and the bytes,
  dtype and shape of every parameter (hashed where they are, in rows of 1 MiB:
  :mod:`kvstore.bridge.digests`; on a CUDA GPU by a kernel, elsewhere on
  every core).
* a **kvstore model** (``kvstore.model.Model``): its directory's fingerprint
  when it was loaded from one (``model.source_path``), else its ``config``
  and parameters like an mlx-lm model.

Weight files are hashed with xxh3-128 (about 10 GB/s a core, files on
several cores at once, so the first fingerprint of a multi-GB model costs
about what reading it from the page cache does) and the per-file digests
are cached by file identity (path, size, mtime_ns, inode, device) in
``$XDG_CACHE_HOME/kvstore/file-digests.json`` (``~/.cache/...`` by default),
so a repeat costs a few ``stat`` calls. A non-cryptographic hash is enough
here: namespaces separate models that differ by accident; anyone able to
write into a shared store can write any key anyway. Block keys, which address content, use BLAKE2b.

``mlx_lm_fingerprint(model_or_dir)`` is the fingerprint of the model *mlx-lm*
runs: ``model_fingerprint`` of the object ``mlx_lm.load(dir)`` returns. An
object and the directory it was loaded from get the same one (the directory's
is computed once, by loading it lazily, and cached under its files' digests),
so a server and a ``stream_generate`` script share stored prompts.

``namespace_for(fingerprint, layer_layout, tenant=None)`` folds the
fingerprint, the cache geometry and an optional tenant salt into 16 hex
digits. No environment variable is needed for two processes or hosts to
agree; ``KVSTORE_CACHE_DIR`` (:mod:`kvstore.cache_dir`) only moves the digest cache.

.. versionchanged:: 0.1 parameters of model objects are hashed in rows of
   1 MiB (so a GPU hashes them in device memory: an 8B model in under a
   second instead of 8 s); an in-memory model's fingerprint differs from the
   one earlier versions computed, so blocks they stored under it are cold
   misses once. Directory fingerprints (file digests) are unchanged.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import tempfile
import threading
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

import xxhash

from kvstore.cache_dir import cache_dir
from kvstore.errors import CapabilityError, KVStoreError, StoreConfigError
from kvstore.threads import cores

__all__ = [
    "model_fingerprint",
    "mlx_lm_fingerprint",
    "namespace_for",
    "file_digest",
    "digest_cache_path",
    "cache_directory_digests",
]

_WEIGHT_SUFFIXES = (".safetensors", ".npz", ".gguf")
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "spiece.model",
)
_CHUNK = 8 << 20
_CACHE_LIMIT = 4096
_FINGERPRINT_PERSON = b"kvstore-model/v1"
#: How a parameter's bytes are hashed (rows of 1 MiB: :mod:`kvstore.bridge.digests`).
_ROWS_TAG = "r1m"
_NAMESPACE_PERSON = b"kvstore-nspace/1"


def digest_cache_path() -> Path:
    """Where per-file digests are cached (``KVSTORE_CACHE_DIR`` or the XDG cache)."""
    return cache_dir() / "file-digests.json"


def _canonical_json(obj: Any, what: str) -> bytes:
    def default(o: Any) -> Any:
        if dataclasses.is_dataclass(o) and not isinstance(o, type):
            return dataclasses.asdict(o)
        if hasattr(o, "item") and callable(o.item):  # numpy scalars
            return o.item()
        if isinstance(o, (set, frozenset)):
            return sorted(o)
        if isinstance(o, Path):
            return str(o)
        raise TypeError(type(o).__name__)

    try:
        text = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=default)
    except (TypeError, ValueError) as exc:
        raise StoreConfigError(
            f"[fingerprint] {what} must be JSON-serialisable (dicts, lists, numbers, "
            f"strings); it contains {exc}.",
            found=str(exc),
        ) from exc
    return text.encode("utf-8")


def _hash_file(path: Path) -> str:
    """xxh3-128 of the file's bytes, read in chunks. Not hashed from a mapping (1.6x
    faster from the page cache here): a file truncated while mapped kills the process
    with SIGBUS, and a model directory may be rewritten while a server starts."""
    h = xxhash.xxh3_128()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def _load_cache(path: Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _save_cache(path: Path, cache: dict[str, Any]) -> None:
    """Write the cache atomically; a cache we cannot write is only a slower next start."""
    if len(cache) > _CACHE_LIMIT:
        for key in list(cache)[: len(cache) - _CACHE_LIMIT]:
            del cache[key]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".file-digests.")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(cache, f)
        os.replace(tmp, path)
    except OSError:
        pass


def file_digest(
    path: str | os.PathLike[str],
    cache: dict[str, Any] | None = None,
    lock: threading.Lock | None = None,
) -> str:
    """xxh3-128 of a file's content, served from ``cache`` when the file is unchanged
    (``lock`` guards ``cache`` when several threads share it)."""
    p = Path(path).resolve()
    st = p.stat()
    identity = [st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev]
    key = str(p)
    guard = lock or contextlib.nullcontext()
    if cache is not None:
        with guard:
            hit = cache.get(key)
        if isinstance(hit, dict) and hit.get("identity") == identity:
            return str(hit["xxh3_128"])
    digest = _hash_file(p)
    if cache is not None:
        with guard:
            cache.pop(key, None)  # re-insert at the end: the cache keeps the newest entries
            cache[key] = {"identity": identity, "xxh3_128": digest}
    return digest


def _directory_manifest(root: Path) -> list[tuple[str, str]]:
    if not root.is_dir():
        raise StoreConfigError(
            f"[fingerprint] {root} is not a directory; pass an mlx-lm model directory "
            f"(config.json + weights), an mlx-lm model, or a kvstore model.",
            path=str(root),
        )
    config = root / "config.json"
    if not config.is_file():
        raise StoreConfigError(
            f"[fingerprint] {root} has no config.json: not a model directory.", path=str(root)
        )
    weights = sorted(p for p in root.iterdir() if p.is_file() and p.name.endswith(_WEIGHT_SUFFIXES))
    if not weights:
        raise StoreConfigError(
            f"[fingerprint] {root} has no weight files ({', '.join(_WEIGHT_SUFFIXES)}); a "
            f"fingerprint of the config alone would collide across fine-tunes.",
            path=str(root),
        )
    try:
        parsed = json.loads(config.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise StoreConfigError(f"[fingerprint] {config} is not valid JSON: {exc}.") from exc
    manifest = [
        ("config.json", hashlib.blake2b(_canonical_json(parsed, "config.json")).hexdigest())
    ]
    cache_path = digest_cache_path()
    cache = _load_cache(cache_path)
    lock = threading.Lock()
    before = json.dumps(cache, sort_keys=True)
    files = [(f"tokenizer/{n}", root / n) for n in _TOKENIZER_FILES if (root / n).is_file()]
    index = root / "model.safetensors.index.json"
    if index.is_file():
        files.append(("weights/index", index))
    files += [(f"weights/{path.name}", path) for path in weights]
    # Shards on several cores at once (xxhash releases the GIL); cache hits cost a stat.
    with ThreadPoolExecutor(min(8, cores())) as pool:
        digests = list(pool.map(lambda f: file_digest(f[1], cache, lock), files))
    manifest += [(name, digest) for (name, _), digest in zip(files, digests, strict=True)]
    if json.dumps(cache, sort_keys=True) != before:
        _save_cache(cache_path, cache)
    return manifest


def cache_directory_digests(directory: str | os.PathLike[str]) -> None:
    """Hash a model directory's files into the digest cache, where a fingerprint of it
    reads them first: run beside loading its weights (the two read the same pages), the
    first fingerprint of a new model then costs a few ``stat`` calls. What fails here
    is left for the fingerprint to raise."""
    with contextlib.suppress(KVStoreError, OSError):
        _directory_manifest(Path(directory).expanduser())


def _parameter_manifest(model: Any) -> list[tuple[str, str]]:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from kvstore.bridge.digests import array_digests

    params = [
        (name, value)
        for name, value in cast(list[tuple[str, Any]], tree_flatten(model.parameters()))
        if isinstance(value, mx.array)
    ]
    if not params:
        raise StoreConfigError(
            f"[fingerprint] {type(model).__name__} has no parameters to fingerprint; "
            f"without weights the fingerprint would collide across models."
        )
    mx.eval([value for _, value in params])
    digests = array_digests([value for _, value in params])
    return [
        (f"param/{name}", f"{value.dtype}:{tuple(value.shape)}:{_ROWS_TAG}:{digest}")
        for (name, value), digest in zip(params, digests, strict=True)
    ]


def _object_manifest(model: Any, config: Any) -> list[tuple[str, str]]:
    digest = hashlib.blake2b(_canonical_json(config, "the model config")).hexdigest()
    return [("config", digest), *_parameter_manifest(model)]


def _combine(manifest: Iterable[tuple[str, str]]) -> str:
    h = hashlib.blake2b(digest_size=32, person=_FINGERPRINT_PERSON)
    for name, digest in sorted(manifest):
        h.update(f"{name}\0{digest}\n".encode())
    return h.hexdigest()


def model_fingerprint(model: Any, *, tokenizer: Any = None) -> str:
    """A 64-hex-digit fingerprint of a model's config, tokenizer and weights.

    Args:
        model: a model directory (``str`` or path), an mlx-lm model, or a
            kvstore model.
        tokenizer: for a model object, optionally its tokenizer (a directory
            holding tokenizer files, or any object with a JSON-able ``vocab``
            or ``get_vocab()``); a directory's tokenizer files are always included.

    Raises:
        StoreConfigError: a directory without config.json or weight files.
        CapabilityError: an object that is none of the supported kinds.
    """
    if isinstance(model, (str, os.PathLike)):
        return _combine(_directory_manifest(Path(model).expanduser()))
    if hasattr(model, "source_path") and hasattr(model, "config"):  # a kvstore model
        if model.source_path is not None:
            return _combine(_directory_manifest(Path(model.source_path)))
        manifest = _object_manifest(model, model.config)
    elif hasattr(model, "args") and hasattr(model, "parameters"):  # an mlx-lm model
        manifest = _object_manifest(model, model.args)
    else:
        raise CapabilityError(
            f"[fingerprint] Cannot fingerprint a {type(model).__name__}; pass a model "
            f"directory, an mlx-lm model (with .args) or a kvstore model.",
            found=type(model).__name__,
        )
    if tokenizer is not None:
        manifest.append(("tokenizer", _tokenizer_digest(tokenizer)))
    return _combine(manifest)


def _mlx_lm_key(root: Path, adapter_path: str | os.PathLike[str] | None) -> str:
    """The digest-cache key of ``mlx_lm.load(root, adapter_path=...)``: the files' digests."""
    key = f"mlx-lm-model/{_combine(_directory_manifest(root))}"
    if adapter_path is not None:
        adapters = Path(adapter_path).expanduser()
        files = sorted(p for p in adapters.iterdir() if p.is_file()) if adapters.is_dir() else []
        if not files:
            raise StoreConfigError(
                f"[fingerprint] The adapter path {adapters} is not a directory of adapter "
                f"files (adapter_config.json, adapters.safetensors).",
                path=str(adapters),
            )
        key += "/adapters/" + _combine((p.name, file_digest(p)) for p in files)
    return key


def _load_lazily(root: Path, adapter_path: str | os.PathLike[str] | None) -> Any:
    """The model ``mlx_lm.load`` builds from ``root``, its weights not read yet."""
    from mlx_lm.utils import load_adapters, load_model

    try:
        model, _ = load_model(root, lazy=True)
    except (ValueError, FileNotFoundError) as exc:  # an architecture mlx-lm does not have
        raise CapabilityError(
            f"[fingerprint] mlx-lm cannot load {root}: {exc}", found=str(root)
        ) from exc
    if adapter_path is not None:
        model = load_adapters(model, str(adapter_path))
    return model


def mlx_lm_fingerprint(
    model: Any,
    *,
    source: str | os.PathLike[str] | None = None,
    adapter_path: str | os.PathLike[str] | None = None,
) -> str:
    """The fingerprint of the model mlx-lm runs, equal for an object and its directory.

    It is :func:`model_fingerprint` of the mlx-lm model object (its args and
    parameters), so the tokenizer is not part of it (stored K/V depends on
    token ids and weights only). A directory's is computed once by loading it
    lazily and hashing the parameters, then served from the digest cache
    under the digests of its files (and of ``adapter_path``'s); an object's is
    hashed from memory, unless ``source`` names the directory it was loaded
    from unchanged, whose cached fingerprint is used (and recorded if missing).

    Args:
        model: an mlx-lm model directory, or an mlx-lm model object.
        source: for an object, the directory ``mlx_lm.load`` read it from.
        adapter_path: the LoRA adapters ``mlx_lm.load(..., adapter_path=)`` applied
            (for an object, only with ``source``: its parameters already hold them).

    Raises:
        StoreConfigError: a directory without config.json or weights, or an
            adapter path without files.
        CapabilityError: an architecture mlx-lm cannot load, or an object with no
            parameters.
    """
    directory = model if isinstance(model, (str, os.PathLike)) else source
    if directory is None:
        if adapter_path is not None:
            raise StoreConfigError(
                "[fingerprint] adapter_path describes a directory's load; a model object "
                "already holds its adapters (pass source= with it, or neither).",
                found=str(adapter_path),
            )
        return model_fingerprint(model)
    root = Path(directory).expanduser()
    key = _mlx_lm_key(root, adapter_path)
    cache_path = digest_cache_path()
    cache = _load_cache(cache_path)
    hit = cache.get(key)
    if isinstance(hit, dict) and isinstance(hit.get("fingerprint"), str):
        return str(hit["fingerprint"])
    obj = _load_lazily(root, adapter_path) if directory is model else model
    fingerprint = model_fingerprint(obj)
    cache = _load_cache(cache_path)  # re-read: the load may have taken a while
    cache[key] = {"fingerprint": fingerprint}
    _save_cache(cache_path, cache)
    return fingerprint


def _tokenizer_digest(tokenizer: Any) -> str:
    if isinstance(tokenizer, (str, os.PathLike)):
        root = Path(tokenizer)
        parts = [(n, file_digest(root / n)) for n in _TOKENIZER_FILES if (root / n).is_file()]
        return _combine(parts)
    vocab = (
        tokenizer.get_vocab()
        if hasattr(tokenizer, "get_vocab")
        else getattr(tokenizer, "vocab", None)
    )
    if not isinstance(vocab, Mapping):
        raise CapabilityError(
            f"[fingerprint] Cannot fingerprint a tokenizer of type {type(tokenizer).__name__}; "
            f"pass its directory, or an object with get_vocab().",
            found=type(tokenizer).__name__,
        )
    return hashlib.blake2b(_canonical_json(dict(vocab), "the tokenizer vocabulary")).hexdigest()


def namespace_for(fingerprint: str, layer_layout: Any, tenant: str | None = None) -> str:
    """A 16-hex-digit namespace for a model fingerprint, its cache layout and a tenant.

    Args:
        fingerprint: from :func:`model_fingerprint`.
        layer_layout: what the caches look like per layer (``model.layer_layout()``:
            heads, head dims, sliding windows); any JSON-able value.
        tenant: an optional salt keeping tenants of a shared store apart.
    """
    if not isinstance(fingerprint, str) or not fingerprint:
        raise StoreConfigError(
            f"[namespace_for] fingerprint must be a non-empty str from model_fingerprint(); "
            f"received {fingerprint!r}.",
            found=fingerprint,
        )
    if tenant is not None and not isinstance(tenant, str):
        raise StoreConfigError(
            f"[namespace_for] tenant must be a str or None; received {tenant!r}.", found=tenant
        )
    h = hashlib.blake2b(digest_size=8, person=_NAMESPACE_PERSON)
    h.update(fingerprint.encode("utf-8") + b"\0")
    h.update(_canonical_json(layer_layout, "layer_layout") + b"\0")
    if tenant is not None:
        h.update(b"tenant\0" + tenant.encode("utf-8"))
    return h.hexdigest()
