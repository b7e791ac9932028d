"""``.safetensors`` snapshot files: any tool that reads safetensors can open them.

Tensors are named ``layer.{i}.{name}`` (``layer.3.keys.scales``); the header
-- the same layer entries a record carries, minus offsets -- is one JSON
string under the metadata key ``"kvstore"``, since MLX metadata is str -> str::

    {"format": 1, "writer": "kvstore 0.1.0", "meta": {...},
     "layers": [None | {"signature", "codec", "codec_version", "start", "stop",
                        "meta", "tensors": [{"name", "dtype", "shape"}]}]}

safetensors has no checksum; use records where integrity matters.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any, cast

import mlx.core as mx

from kvstore.abc.codec import Snapshot
from kvstore.codecs.arrays import as_mlx, dtype_name
from kvstore.codecs.header import (
    BOUNDS,
    FORMAT_VERSION,
    corrupt,
    layer_entry,
    tensor_manifest,
    writer,
)
from kvstore.codecs.header_parse import parse_header

__all__ = ["METADATA_KEY", "save_snapshots", "load_snapshots", "read_safetensors"]

#: The safetensors metadata key holding the JSON header.
METADATA_KEY = "kvstore"


def save_snapshots(
    path: str | os.PathLike[str],
    layers: Sequence[Snapshot | None],
    *,
    meta: Mapping[str, Any] | None = None,
) -> None:
    """Write ``layers`` (a snapshot per layer, ``None`` where absent) to a ``.safetensors`` file.

    Raises:
        UnknownSignatureError: a snapshot of a kind no codec serves.
        TypeError: ``meta`` (or a snapshot's meta) is not JSON-able.
    """
    arrays: dict[str, mx.array] = {}
    entries: list[dict[str, Any] | None] = []
    for i, snap in enumerate(layers):
        if snap is None:
            entries.append(None)
            continue
        entries.append(layer_entry(snap, tensor_manifest(snap)))
        arrays.update({f"layer.{i}.{name}": as_mlx(a) for name, a in snap.tensors.items()})
    header = {
        "format": FORMAT_VERSION,
        "writer": writer(),
        "layers": entries,
        "meta": dict(meta or {}),
    }
    try:
        text = json.dumps(header, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"[save_snapshots] The header is not JSON-able: {exc}.") from exc
    mx.save_safetensors(os.fspath(path), arrays, metadata={METADATA_KEY: text})


def read_safetensors(
    op: str, path: str | os.PathLike[str]
) -> tuple[dict[str, mx.array], dict[str, str]]:
    """The tensors and str metadata of a ``.safetensors`` file.

    Raises:
        CorruptEntryError: not a readable safetensors file.
    """
    try:
        arrays, metadata = mx.load(os.fspath(path), return_metadata=True)
    except (RuntimeError, ValueError, OSError) as exc:
        raise corrupt(op, f"'{os.fspath(path)}' is not a readable safetensors file: {exc}") from exc
    return cast(dict[str, mx.array], arrays), cast(dict[str, str], metadata)


def load_snapshots(path: str | os.PathLike[str]) -> tuple[list[Snapshot | None], dict[str, Any]]:
    """The snapshots and user meta of a file written by :func:`save_snapshots`.

    Tensors are owned ``mx.array``s.

    Raises:
        CorruptEntryError: not a kvstore snapshot file, or its header and
            tensors disagree.
        FormatVersionError: a format this reader does not read.
    """
    op = "load_snapshots"
    arrays, metadata = read_safetensors(op, path)
    text = metadata.get(METADATA_KEY)
    if text is None:
        hint = " (an mlx-lm prompt cache? use import_prompt_cache)" if "1.0" in metadata else ""
        raise corrupt(op, f"'{os.fspath(path)}' has no '{METADATA_KEY}' header{hint}.")
    if len(text) > BOUNDS.header_bytes:
        raise corrupt(op, f"The header is {len(text)} chars; the bound is {BOUNDS.header_bytes}.")
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise corrupt(op, f"The header is not JSON: {type(exc).__name__}.") from exc
    f, layers = parse_header(op, obj, located=False)
    expected: set[str] = set()
    out: list[Snapshot | None] = []
    for i, layer in enumerate(layers):
        if layer is None:
            out.append(None)
            continue
        tensors: dict[str, mx.array] = {}
        for t in layer.tensors:
            key = f"layer.{i}.{t.name}"
            array = arrays.get(key)
            if array is None or dtype_name(array) != t.dtype or tuple(array.shape) != t.shape:
                found = None if array is None else (dtype_name(array), tuple(array.shape))
                raise corrupt(
                    op, f"Tensor '{key}' should be {t.dtype} {list(t.shape)}; found {found}."
                )
            tensors[t.name] = array
            expected.add(key)
        out.append(Snapshot(layer.signature, layer.start, layer.stop, tensors, layer.meta))
    extra = sorted(set(arrays) - expected)
    if extra:
        raise corrupt(op, f"Tensors the header does not describe: {', '.join(extra[:5])}.")
    return out, f["meta"]
