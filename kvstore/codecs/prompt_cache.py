"""mlx-lm prompt-cache files (``save_prompt_cache``/``load_prompt_cache``), both ways.

mlx-lm writes ``tree_flatten([c.state for c in cache])`` as tensors and a
three-part metadata tree, in one of two layouts:

* current (mlx-lm 0.32.0 on, the tested releases):
  ``0.*`` user metadata, ``1.*`` class names, ``2.*`` scalars -- ``2.0`` is
  ``""``, then ``(position, kind)`` pairs naming which tensors are really
  ints/strings/None. States are ``(keys, values, offset[, ...])`` with
  capacity-padded buffers.
* legacy (up to 0.31.3, the last release Python 3.10 gets): ``0.*`` each cache's
  ``meta_state`` strings, ``1.*`` user metadata, ``2.*`` class names. States are
  ``(keys, values)`` already cut to ``offset``. Each release loads only its own
  ``meta_state`` fields: up to 0.28.0 they began with the cache's ``step``
  (``QuantizedKVCache``: step, offset, group size, bits), from 0.28.1 they do not.

Import detects the layout (and reads both kinds of ``meta_state``), rebuilds each
cache's state and returns its logical snapshots (padding dropped, rings in temporal
order). Export writes either layout without padding (legacy: 0.28.1's to 0.31's
fields), which stock ``load_prompt_cache`` of those releases loads.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from kvstore.abc.codec import Snapshot
from kvstore.caches import KVCache, QuantizedKVCache, RotatingKVCache
from kvstore.codecs.files import read_safetensors
from kvstore.codecs.registry import codec_for, get_codec
from kvstore.codecs.rows import slice_rows
from kvstore.errors import CapabilityError, CorruptEntryError
from kvstore.mlx_lm_installed import mlx_lm_version, version_tuple

__all__ = [
    "CURRENT_LAYOUT_SINCE",
    "LAYOUTS",
    "LOADED_BY",
    "ImportedPromptCache",
    "export_prompt_cache",
    "import_prompt_cache",
    "installed_file_layout",
]

#: The layouts of a prompt-cache file (module docstring): what import reports, what
#: export writes.
LAYOUTS = ("current", "legacy")
#: The first mlx-lm release that writes and loads the current layout; the ones before
#: it load the legacy one only.
CURRENT_LAYOUT_SINCE = (0, 32, 0)
#: The mlx-lm releases whose ``load_prompt_cache`` loads what export writes, by layout.
LOADED_BY = {"current": "mlx-lm >= 0.32", "legacy": "mlx-lm 0.28.1 to 0.31"}


def installed_file_layout() -> str:
    """The layout the installed mlx-lm loads (:data:`LAYOUTS`): ``"legacy"`` for a release
    before 0.32 (what Python 3.10 gets), ``"current"`` for a later one or none. Read from
    mlx-lm's package metadata: kvstore's mlx-lm integration does not import with 0.31 or
    older."""
    found = mlx_lm_version()
    return (
        "legacy" if found is not None and version_tuple(found) < CURRENT_LAYOUT_SINCE else "current"
    )


# mlx-lm class name -> (our class with the same state layout, its kind)
_CLASSES: dict[str, tuple[Any, str]] = {
    cls.__name__: (cls, cls.family.kind) for cls in (KVCache, QuantizedKVCache, RotatingKVCache)
}
_CLASS_OF_KIND = {kind: name for name, (_, kind) in _CLASSES.items()}


@dataclass(frozen=True)
class ImportedPromptCache:
    """What a prompt-cache file held.

    Attributes:
        layers: per layer, the snapshots that restore it (one, or a ring's
            sink range and window).
        metadata: the user metadata mlx-lm saved alongside.
        layout: ``"current"`` or ``"legacy"`` (see the module docstring).
    """

    layers: list[list[Snapshot]]
    metadata: dict[str, str]
    layout: str

    def caches(self) -> list[Any]:
        """Live kvstore caches restored from the file."""
        return [get_codec(snaps[0].signature).restore(snaps) for snaps in self.layers]


def import_prompt_cache(path: str | os.PathLike[str]) -> ImportedPromptCache:
    """Read a file written by mlx-lm's ``save_prompt_cache`` (either layout).

    Raises:
        CorruptEntryError: the file is not an mlx-lm prompt cache.
        CapabilityError: it holds a cache class kvstore has no codec for.
    """
    op = "import_prompt_cache"
    arrays, flat_meta = read_safetensors(op, path)
    try:
        meta_tree = tree_unflatten(list(flat_meta.items()))
        states = tree_unflatten(list(arrays.items())) if arrays else []
    except Exception as exc:  # tree_unflatten raises several types on junk keys
        raise CorruptEntryError(f"[{op}] Not a prompt-cache layout: {exc}.") from exc
    if not (isinstance(meta_tree, list) and len(meta_tree) == 3):
        raise CorruptEntryError(f"[{op}] No mlx-lm prompt-cache metadata in '{os.fspath(path)}'.")
    first, second, third = meta_tree
    if isinstance(third, list) and third[:1] == [""]:
        layout, user, classes = "current", first, second
        try:
            for position, kind in third[1:]:
                _set_scalar(states, position, kind)
        except (ValueError, TypeError, IndexError, KeyError) as exc:
            raise CorruptEntryError(f"[{op}] Bad scalar table in the metadata: {exc}.") from exc
        infos: list[Any] = [None] * len(classes or [])
    elif isinstance(third, list) and all(isinstance(c, str) and c for c in third):
        layout, user, classes, infos = "legacy", second, third, first or [None] * len(third)
    else:
        raise CorruptEntryError(f"[{op}] Unrecognised prompt-cache metadata layout.")
    classes = classes or []
    if len(states) != len(classes):
        raise CorruptEntryError(
            f"[{op}] {len(classes)} cache classes but {len(states)} cache states."
        )
    layers = []
    for i, (name, state, info) in enumerate(zip(classes, states, infos, strict=True)):
        if name not in _CLASSES:
            raise CapabilityError(
                f"[{op}] Layer {i} is an mlx-lm {name}; kvstore imports {', '.join(_CLASSES)}.",
                found=name,
                supported=list(_CLASSES),
            )
        try:
            full = state if layout == "current" else _legacy_state(name, state, info)
            # tree_unflatten gives lists where mlx-lm's states hold tuples
            full = tuple(tuple(x) if isinstance(x, list) else x for x in full)
            cache: Any = _CLASSES[name][0].from_state(full)
            layers.append(codec_for(cache).snapshot_held(cache))
        except (ValueError, TypeError, IndexError, AttributeError) as exc:
            raise CorruptEntryError(
                f"[{op}] Layer {i} ({name}) does not hold an mlx-lm {name} state: {exc}."
            ) from exc
    return ImportedPromptCache(layers, dict(user or {}), layout)


def export_prompt_cache(
    path: str | os.PathLike[str],
    caches: Sequence[Any],
    metadata: Mapping[str, str] | None = None,
    *,
    layout: str = "current",
) -> None:
    """Write ``caches`` as an mlx-lm prompt-cache file (no padding) in ``layout``.

    Stock ``mlx_lm.models.cache.load_prompt_cache`` loads it into mlx-lm's own
    ``KVCache``/``QuantizedKVCache``/``RotatingKVCache``: ``"current"`` in mlx-lm
    0.32 and later, ``"legacy"`` in 0.28.1 to 0.31 (:data:`LOADED_BY`). A legacy file
    holds what those releases' ``save_prompt_cache`` writes of the same caches, tensor
    for tensor, but for a window just after a multi-token chunk: mlx-lm keeps the
    chunk's longer buffer, the export the window it ends in.

    Raises:
        CapabilityError: a cache family mlx-lm has no class for
            (``kv:rotating-quant``, TurboQuant).
        ValueError: ``layout`` is not one of :data:`LAYOUTS`.
    """
    if layout not in LAYOUTS:
        raise ValueError(
            f"[export_prompt_cache] layout is one of {', '.join(LAYOUTS)}; received {layout!r}."
        )
    states, classes = [], []
    for i, cache in enumerate(caches):
        codec = codec_for(cache)
        name = _CLASS_OF_KIND.get(codec.kind)
        if name is None:
            raise CapabilityError(
                f"[export_prompt_cache] Layer {i} is '{codec.signature}', which mlx-lm has no "
                f"cache class for; it exports {', '.join(_CLASS_OF_KIND)}.",
                signature=codec.signature,
            )
        # Our restore builds exactly the buffer mlx-lm expects (rings rotated
        # as they were); export its used rows only.
        rebuilt = codec.restore(codec.snapshot_held(cache))
        used = min(int(rebuilt.offset), int(_rows(rebuilt.keys)))
        rebuilt.keys = slice_rows(rebuilt.keys, 0, used)
        rebuilt.values = slice_rows(rebuilt.values, 0, used)
        states.append(rebuilt.state)
        classes.append(name)
    user = dict(metadata or {})
    if layout == "legacy":
        legacy = [_legacy_of(name, state) for name, state in zip(classes, states, strict=True)]
        tensors = dict(tree_flatten([arrays for arrays, _ in legacy]))
        flat_meta = dict(tree_flatten([[info for _, info in legacy], user, classes]))
        mx.save_safetensors(os.fspath(path), tensors, flat_meta)
        return
    scalars: list[Any] = [""]  # mlx-lm: "must be non-empty otherwise tree_flatten drops it"
    tensors = {}
    for key, value in cast(list[tuple[str, Any]], tree_flatten(states)):
        if isinstance(value, int):
            scalars.append((key, "scalar"))
            value = mx.array(value)
        tensors[key] = value
    flat_meta = dict(tree_flatten([user, classes, scalars]))
    mx.save_safetensors(os.fspath(path), tensors, flat_meta)


def _rows(tree: Any) -> int:
    return (tree[0] if isinstance(tree, (tuple, list)) else tree).shape[2]


def _set_scalar(states: list[Any], position: str, kind: str) -> None:
    """Turn the tensor at ``position`` ("3.2") back into the Python value mlx-lm saved."""
    *path, last = (int(p) for p in position.split("."))
    parent = states
    for step in path:
        parent = parent[step]
    array = parent[last]
    if kind == "scalar":
        parent[last] = array.item()
    elif kind == "none":
        parent[last] = None
    elif kind == "string":
        parent[last] = "".join(chr(c) for c in array.tolist())
    else:
        raise CorruptEntryError(f"[import_prompt_cache] Unknown scalar kind {kind!r}.")


def _legacy_state(name: str, state: Sequence[Any], info: Any) -> tuple[Any, ...]:
    """An older (keys, values) + ``meta_state`` strings as today's state tuple."""
    keys, values = state[0], state[1]
    fields = [int(x) for x in (info or ())] if not isinstance(info, str) else []
    if name == "KVCache":
        return keys, values, _rows(tuple(keys) if isinstance(keys, list) else keys)
    if name == "QuantizedKVCache":
        offset, group_size, bits = fields[-3:]  # (step,) offset, group_size, bits
        return tuple(keys), tuple(values), offset, group_size, bits
    keep, max_size, *rest = fields  # keep, max_size, (step,) offset, _idx
    return keys, values, rest[-2], keep, max_size, rest[-1]


def _legacy_of(name: str, state: Sequence[Any]) -> tuple[tuple[Any, Any], str | tuple[str, ...]]:
    """Today's state tuple as the legacy ``(keys, values)`` and ``meta_state`` strings of
    mlx-lm 0.28.1 to 0.31 (the inverse of :func:`_legacy_state`)."""
    keys, values, offset, *rest = state
    if name == "KVCache":
        return (keys, values), ""  # its offset is its rows
    if name == "QuantizedKVCache":
        group_size, bits = rest
        return (tuple(keys), tuple(values)), tuple(map(str, (offset, group_size, bits)))
    keep, max_size, idx = rest
    return (keys, values), tuple(map(str, (keep, max_size, offset, idx)))
