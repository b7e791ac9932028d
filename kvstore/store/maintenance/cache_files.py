"""Prompt caches in files, into and out of a store.

Two file formats hold a whole prompt's KV cache:

* mlx-lm prompt-cache files (``mlx_lm.models.cache.save_prompt_cache``), in
  both of mlx-lm's layouts (:mod:`kvstore.codecs.prompt_cache`). mlx-lm keeps
  no token ids in them, so whoever imports one says which tokens it holds;
* kvstore snapshot files (``.safetensors``, :mod:`kvstore.codecs.files`), one
  snapshot per layer.

:func:`import_cache_file` saves a file's caches under a namespace, like a
session saving its prompt; :func:`export_cache_file` restores the longest
stored prefix of some tokens, into the cache families the records hold, and
writes it as either format (stock ``load_prompt_cache`` loads the mlx-lm one).
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from kvstore.abc.cache import signature_string
from kvstore.abc.store import Match, PrefixStore, SaveResult
from kvstore.codecs import get_codec, read_header, restore, snapshot_held
from kvstore.codecs.files import METADATA_KEY, load_snapshots, read_safetensors, save_snapshots
from kvstore.codecs.prompt_cache import LAYOUTS, export_prompt_cache, import_prompt_cache
from kvstore.errors import CapabilityError, CorruptEntryError, StoreConfigError
from kvstore.store import keys as K
from kvstore.store.maintenance.inventory import require_namespace

__all__ = [
    "FORMATS",
    "CacheFile",
    "ImportResult",
    "ExportResult",
    "read_cache_file",
    "check_tokens",
    "model_namespace",
    "namespace_layers",
    "import_cache_file",
    "export_cache_file",
    "stored_prefix",
]

#: ``export_cache_file`` formats.
FORMATS = ("mlx-lm", "kvstore")
Format = Literal["mlx-lm", "kvstore"]

_FORMATS_HELP = "an mlx-lm prompt-cache file (save_prompt_cache) or a kvstore snapshot file"
_OPERATION = re.compile(r"^\[[\w.]+\] ")


def _reason(exc: Exception) -> str:
    """``exc``'s message without its ``[operation]`` prefix, to quote inside another."""
    return _OPERATION.sub("", str(exc)).rstrip(".")


@dataclass(frozen=True)
class CacheFile:
    """A file's prompt cache, as live kvstore caches.

    Attributes:
        path: the file.
        format: what it was (``"mlx-lm prompt cache (current layout)"``...).
        caches: one live cache per layer.
        tokens: the tokens every layer holds (the caches' common offset).
    """

    path: Path
    format: str
    caches: list[Any]
    tokens: int

    @property
    def families(self) -> list[str]:
        """Each layer's signature."""
        return [signature_string(c) for c in self.caches]


def read_cache_file(path: str | os.PathLike[str], operation: str = "import") -> CacheFile:
    """The prompt cache in ``path``: an mlx-lm prompt-cache file (either layout)
    or a kvstore snapshot file, told apart by their metadata.

    Raises:
        FileNotFoundError: no file at ``path``.
        CorruptEntryError: a file of neither format, or layers that disagree
            on how many tokens they hold.
        CapabilityError: a cache class or family kvstore cannot rebuild.
    """
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(
            f"[{operation}] No file at {file}. Give {_FORMATS_HELP} (a .safetensors file)."
        )
    try:
        _, metadata = read_safetensors(operation, file)
        if METADATA_KEY in metadata:
            layers, _ = load_snapshots(file)
            if any(s is None for s in layers):
                missing = [i for i, s in enumerate(layers) if s is None]
                raise CorruptEntryError(
                    f"[{operation}] {file} has no snapshot for layers {missing}; a prompt "
                    f"cache needs every layer.",
                    path=str(file),
                )
            kind, caches = "kvstore snapshot file", [restore(s) for s in layers if s is not None]
        else:
            imported = import_prompt_cache(file)
            layout = (
                "current layout"
                if imported.layout == "current"
                else "legacy layout, mlx-lm <= 0.31"
            )
            kind, caches = f"mlx-lm prompt cache ({layout})", imported.caches()
    except CorruptEntryError as exc:
        raise CorruptEntryError(
            f"[{operation}] {file} is not {_FORMATS_HELP}: {_reason(exc)}.", path=str(file)
        ) from exc
    offsets = sorted({int(c.offset) for c in caches})
    if len(offsets) != 1:
        raise CorruptEntryError(
            f"[{operation}] The layers of {file} hold different numbers of tokens "
            f"({', '.join(map(str, offsets)) or 'no layers'}); a prompt cache holds the same "
            f"prompt in every layer.",
            path=str(file),
            offsets=offsets,
        )
    return CacheFile(file, kind, caches, offsets[0])


def check_tokens(cache_file: CacheFile, tokens: Sequence[int] | np.ndarray, source: str) -> None:
    """Check that ``tokens`` (read from ``source``) are as many as the file's caches hold.

    Raises:
        StoreConfigError: a different count.
    """
    if len(tokens) != cache_file.tokens:
        raise StoreConfigError(
            f"[import] {cache_file.path} holds the KV of {cache_file.tokens} tokens (its "
            f"cache offset) but {source} has {len(tokens)} token ids. Give exactly the token "
            f"ids the cache was computed from.",
            found=len(tokens),
            expected=cache_file.tokens,
        )


def namespace_layers(store: PrefixStore, namespace: str) -> int | None:
    """How many layers the records of ``namespace`` hold (``None``: no record yet)."""
    ns = K.parse_namespace(namespace)
    with store.backend.reader() as view:
        for key in view.keys(K.namespace_dir(ns)):
            if K.split_record_key(key) is not None:
                raw = view.get(key)
                if raw is not None:
                    return len(read_header(raw).layers)
    return None


@dataclass(frozen=True)
class ImportResult:
    """What an import did.

    Attributes:
        saved: the store's account of the save.
        served: tokens of the prompt a later lookup restores (a sliding-window
            layer past its window keeps only the blocks its window held whole).
    """

    namespace: str
    tokens: int
    format: str
    families: list[str]
    saved: SaveResult
    served: int


def import_cache_file(
    store: PrefixStore,
    namespace: str,
    tokens: Sequence[int] | np.ndarray,
    cache_file: CacheFile,
) -> ImportResult:
    """Save ``cache_file``'s caches under ``namespace`` as the KV of ``tokens``.

    Raises:
        StoreConfigError: ``tokens`` are not as many as the caches hold, or the
            namespace's records have another number of layers.
        StoreFullError, ReadOnlyStoreError, StoreUnavailableError: from the store.
    """
    check_tokens(cache_file, tokens, "the tokens")
    held = namespace_layers(store, namespace)
    if held is not None and held != len(cache_file.caches):
        raise StoreConfigError(
            f"[import] Namespace {namespace} holds records of {held} layers; {cache_file.path} "
            f"has {len(cache_file.caches)}. Import it under the namespace of its own model "
            f"(--model DIR computes it).",
            found=len(cache_file.caches),
            expected=held,
        )
    saved = store.save(namespace, tokens, cache_file.caches)
    served = stored_prefix(store, namespace, tokens)[1]
    return ImportResult(
        namespace, len(tokens), cache_file.format, cache_file.families, saved, served
    )


def model_namespace(
    model_dir: str | os.PathLike[str], caches: Sequence[Any], operation: str = "import"
) -> str:
    """The namespace of ``model_dir``'s model holding ``caches``.

    Raises:
        ModelLoadError: not a model directory.
        StoreConfigError: the caches do not fit the model (layers, KV heads).
    """
    from kvstore.model import ModelArgs
    from kvstore.model.loader import read_config
    from kvstore.store import namespace_for_model

    path = Path(model_dir).expanduser()
    layout = ModelArgs.from_config(read_config(path)).layer_layout()
    heads = [_kv_heads(c) for c in caches]
    wanted = [layer["n_kv_heads"] for layer in layout]
    if len(caches) != len(layout) or any(h not in (None, w) for h, w in zip(heads, wanted)):
        raise StoreConfigError(
            f"[{operation}] The file's caches ({len(caches)} layers, KV heads {heads}) do not "
            f"fit the model in {path} ({len(layout)} layers, KV heads {wanted}). Give the "
            f"model the cache was computed with.",
            found=len(caches),
            expected=len(layout),
        )
    return namespace_for_model(path, caches=caches)


def _kv_heads(cache: Any) -> int | None:
    keys = getattr(cache, "keys", None)
    if isinstance(keys, tuple):
        keys = keys[0]
    shape = getattr(keys, "shape", None)
    return int(shape[1]) if shape is not None and len(shape) == 4 else None


def _stored_templates(store: PrefixStore, match: Match) -> list[Any]:
    """Empty caches of the families (and windows) the matched records hold, per layer."""
    templates: list[Any] | None = None
    with store.read(match.blocks) as views:
        headers = [read_header(view) for view in views]
    for header in headers:
        if templates is None:
            templates = [None] * len(header.layers)
        for i, entry in enumerate(header.layers):
            if templates[i] is None and entry is not None:
                codec = get_codec(entry.signature)
                make = getattr(codec, "make_cache", None)
                if make is None:
                    raise CapabilityError(
                        f"[export] The codec of {entry.signature} cannot make an empty cache "
                        f"to restore into.",
                        signature=entry.signature,
                    )
                templates[i] = make(entry.meta)
    return [t for t in templates or [] if t is not None]


def stored_prefix(
    store: PrefixStore, namespace: str, tokens: Sequence[int] | np.ndarray
) -> tuple[list[Any], int]:
    """Caches restored for the longest stored prefix of ``tokens`` (all of them
    when stored), in the families the records hold; ``([], 0)`` when none is.
    """
    toks = K.as_tokens(tokens, "export")
    # A lookup leaves the prompt's last token to the model; one token more
    # (any id) lets it match every token of ``tokens``.
    match = store.lookup(namespace, np.append(toks, np.uint32(0)))
    if not match.hit:
        return [], 0
    templates = _stored_templates(store, match)
    caches = store.restore(match, templates)
    if not caches or not int(caches[0].offset):  # nothing restorable: the templates back
        return [], 0
    return caches, int(caches[0].offset)


@dataclass(frozen=True)
class ExportResult:
    """What an export wrote: ``tokens`` of the ``requested`` ones, to ``path``."""

    path: Path
    format: str
    tokens: int
    requested: int
    families: list[str]
    bytes: int
    #: An mlx-lm file's layout (``"current"``: mlx-lm 0.32 on; ``"legacy"``: 0.28.1 to
    #: 0.31); ``None`` for a kvstore snapshot file.
    layout: str | None = None


def export_cache_file(
    store: PrefixStore,
    namespace: str,
    tokens: Sequence[int] | np.ndarray,
    path: str | os.PathLike[str],
    format: Format = "mlx-lm",
    layout: str = "current",
) -> ExportResult:
    """Write the longest stored prefix of ``tokens`` in ``namespace`` to a file.

    Args:
        store: the store.
        namespace: a namespace the store holds.
        tokens: token ids; the file holds the KV of the longest prefix of them
            the store can restore.
        path: the file; ``.safetensors`` is appended when it has another suffix
            (MLX does), and the result says where it went.
        format: ``"mlx-lm"`` (stock ``load_prompt_cache`` loads it) or
            ``"kvstore"`` (a snapshot file, any family).
        layout: an mlx-lm file's layout: ``"current"`` (mlx-lm 0.32 and later load
            it) or ``"legacy"`` (0.28.1 to 0.31, what Python 3.10 gets).

    Raises:
        StoreConfigError: an unknown format or layout, an unknown namespace, or no
            stored prefix of ``tokens``.
        CapabilityError: a family the format has no class for (TurboQuant and
            quantized windows in mlx-lm files; a window holding its sink tokens
            apart from the rest in a snapshot file).
    """
    if format not in FORMATS:
        raise StoreConfigError(
            f"[export] format is one of {', '.join(FORMATS)}; received {format!r}.",
            found=format,
            supported=list(FORMATS),
        )
    if layout not in LAYOUTS:
        raise StoreConfigError(
            f"[export] layout is one of {', '.join(LAYOUTS)}; received {layout!r}.",
            found=layout,
            supported=list(LAYOUTS),
        )
    require_namespace(store, namespace, "export")
    caches, covered = stored_prefix(store, namespace, tokens)
    if not covered:
        raise StoreConfigError(
            f"[export] Namespace {namespace} of {store.url} holds no prefix of these "
            f"{len(tokens)} tokens (not even the first block). Check the tokens: 'kvstore "
            f"inspect {store.url} --tokens FILE' shows what a lookup finds.",
            namespace=namespace,
        )
    out = Path(path)
    if out.suffix != ".safetensors":
        out = out.with_name(out.name + ".safetensors")
    meta = {"kvstore_namespace": namespace, "kvstore_tokens": str(covered)}
    if format == "mlx-lm":
        try:
            export_prompt_cache(out, caches, meta, layout=layout)
        except CapabilityError as exc:
            raise CapabilityError(
                f"[export] {_reason(exc)}. Use --format kvstore (a kvstore snapshot file holds "
                f"every family).",
                signature=getattr(exc, "signature", None),
            ) from exc
    else:
        save_snapshots(out, [_one_range(i, c) for i, c in enumerate(caches)], meta=meta)
    families = [signature_string(c) for c in caches]
    written = layout if format == "mlx-lm" else None
    return ExportResult(out, format, covered, len(tokens), families, out.stat().st_size, written)


def _one_range(layer: int, cache: Any) -> Any:
    snaps = snapshot_held(cache)
    if len(snaps) != 1:
        raise CapabilityError(
            f"[export] Layer {layer} is a sliding window whose sink tokens lie apart from its "
            f"window (two ranges); a kvstore snapshot file holds one range per layer. Use "
            f"--format mlx-lm.",
            layer=layer,
        )
    return snaps[0]
