"""Conformance checks every codec test calls (numcodecs ``tests/common.py`` style).

* :func:`check_signature` -- parse -> format -> equal, and the registry
  resolves the signature to an equal codec.
* :func:`check_roundtrip` -- snapshot what a cache holds, send it through
  records (both decode paths) and ``.safetensors`` files, restore, and
  assert bit-identical logical content in owned memory with room to grow.
* :func:`check_continue` -- feed the same rows to two caches and assert
  identical outputs, step by step.
* :func:`check_golden` -- decode a committed golden fixture directory and
  compare with what it says it holds.

Failures are ``AssertionError``s saying what differed.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import numpy as np

from kvstore.abc.codec import KVCodec, Snapshot
from kvstore.codecs import (
    decode_record,
    decode_record_to_mlx,
    encode_record,
    get_codec,
    restore,
    snapshot_held,
)
from kvstore.codecs.arrays import as_numpy, dtype_name
from kvstore.codecs.files import load_snapshots, save_snapshots
from kvstore.signature import format_signature, parse_signature

__all__ = [
    "random_kv",
    "fill_cache",
    "leaves",
    "assert_arrays_equal",
    "assert_snapshots_equal",
    "check_signature",
    "check_roundtrip",
    "check_continue",
    "check_golden",
    "GOLDEN_RECORD_SUFFIX",
]

GOLDEN_RECORD_SUFFIX = ".kvst"


def random_kv(
    tokens: int, *, seed: int, heads: int = 2, head_dim: int = 64, dtype: Any = mx.float16
) -> tuple[mx.array, mx.array]:
    """Seeded normal keys and values ``[1, heads, tokens, head_dim]`` in ``dtype``."""
    k, v = mx.random.split(mx.random.key(seed))
    shape = (1, heads, tokens, head_dim)
    return mx.random.normal(shape, key=k).astype(dtype), mx.random.normal(shape, key=v).astype(
        dtype
    )


def fill_cache(cache: Any, updates: Sequence[int], *, seed: int = 0, **shape: Any) -> None:
    """Feed ``cache`` one seeded update per entry of ``updates`` (token counts).

    ``shape``: ``heads``, ``head_dim``, ``dtype`` as for :func:`random_kv`.
    """
    for step, n in enumerate(updates):
        cache.update_and_fetch(*random_kv(n, seed=seed * 7919 + step, **shape))


def leaves(tree: Any) -> list[Any]:
    """The arrays of a row tree or an ``update_and_fetch`` result, in order."""
    if isinstance(tree, (tuple, list)):
        return [leaf for item in tree for leaf in leaves(item)]
    return [tree]


def assert_arrays_equal(a: Any, b: Any, what: str = "array") -> None:
    """Same dtype, same shape, same bits (NaNs included)."""
    assert dtype_name(a) == dtype_name(b), f"{what}: dtype {dtype_name(a)} != {dtype_name(b)}"
    assert tuple(a.shape) == tuple(b.shape), f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    wa, wb = as_numpy(a), as_numpy(b)
    assert wa.tobytes() == wb.tobytes(), f"{what}: contents differ"


def assert_snapshots_equal(a: Sequence[Snapshot | None], b: Sequence[Snapshot | None]) -> None:
    """Same signatures, ranges, meta and bit-identical tensors, layer by layer."""
    assert len(a) == len(b), f"{len(a)} snapshots != {len(b)}"
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if x is None or y is None:
            assert x is None and y is None, f"[{i}] one snapshot is None"
            continue
        assert (x.signature, x.start, x.stop) == (y.signature, y.start, y.stop), (
            f"[{i}] {x.signature} [{x.start}, {x.stop}) != {y.signature} [{y.start}, {y.stop})"
        )
        assert dict(x.meta) == dict(y.meta), f"[{i}] meta {dict(x.meta)} != {dict(y.meta)}"
        assert list(x.tensors) == list(y.tensors), (
            f"[{i}] tensors {list(x.tensors)} != {list(y.tensors)}"
        )
        for name in x.tensors:
            assert_arrays_equal(x.tensors[name], y.tensors[name], f"[{i}] {name}")


def check_signature(signature: str) -> KVCodec:
    """parse -> format is the identity, and the registry's codec is bound to it."""
    assert format_signature(parse_signature(signature)) == signature, signature
    codec = get_codec(signature)
    assert codec.signature == signature and codec.kind == parse_signature(signature).kind
    assert codec == type(codec)(signature) and hash(codec) == hash(type(codec)(signature))
    assert signature in repr(codec)
    return codec


def check_roundtrip(cache: Any) -> list[Any]:
    """Round-trip everything ``cache`` holds through every path; the restored caches.

    Paths: the snapshots as they are; a record decoded to numpy views; a
    record decoded straight to MLX; a ``.safetensors`` file. Each restored
    cache must hold bit-identical snapshots, in arrays that share no memory
    with the record, with room for one more token without reallocating.
    """
    held = snapshot_held(cache)
    record = encode_record(held, meta={"check": "roundtrip"})
    decoded = decode_record(record)
    assert_snapshots_equal(held, decoded.layers)
    to_mlx = decode_record_to_mlx(record)
    assert_snapshots_equal(held, to_mlx.layers)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "snap.safetensors")
        save_snapshots(path, held, meta={"check": "roundtrip"})
        from_file, meta = load_snapshots(path)
    assert meta == {"check": "roundtrip"}
    assert_snapshots_equal(held, from_file)
    record_bytes = np.frombuffer(record, dtype=np.uint8)
    restored = []
    for snaps in (held, decoded.layers, to_mlx.layers, from_file):
        again = restore([s for s in snaps if s is not None])
        assert_snapshots_equal(held, snapshot_held(again))
        assert again.offset == cache.offset
        # A window never grows past max_size; anything else needs room for one more token.
        room = min(again.offset + 1, getattr(again, "max_size", again.offset + 1))
        for leaf in leaves((again.keys, again.values)):
            assert not np.shares_memory(as_numpy(leaf), record_bytes), (
                "restored arrays view the record"
            )
            assert leaf.shape[2] >= room, f"{leaf.shape[2]} rows for offset {again.offset}"
        restored.append(again)
    return restored


def check_continue(
    original: Any, restored: Any, updates: Sequence[int], *, seed: int = 99, **shape: Any
) -> None:
    """Feed both caches the same rows; every ``update_and_fetch`` result must be identical.

    ``shape``: ``heads``, ``head_dim``, ``dtype`` as for :func:`random_kv`.
    """
    for step, n in enumerate(updates):
        k, v = random_kv(n, seed=seed + step, **shape)
        want = leaves(original.update_and_fetch(k, v))
        got = leaves(restored.update_and_fetch(k, v))
        assert len(got) == len(want)
        for i, (a, b) in enumerate(zip(want, got, strict=True)):
            assert_arrays_equal(a, b, f"step {step} (+{n} tokens) output {i}")
        assert original.offset == restored.offset


def check_golden(directory: str | os.PathLike[str]) -> None:
    """Decode every record of a golden fixture and compare with what it holds.

    The directory (``tests/fixtures/golden/<name>/format-<N>/``) holds
    ``config.json`` (how the fixture was made and what it holds),
    ``record-<k>.kvst`` (consecutive blocks, as a store writes them) and
    ``expected.safetensors``: each record's tensors as
    ``record.<k>.layer.<i>.<name>``, and the original cache's held snapshots
    as ``held.layer.<i>.<j>.<name>``.
    """
    root = Path(directory)
    config = json.loads((root / "config.json").read_text())
    expected = cast(dict[str, mx.array], mx.load(str(root / "expected.safetensors")))
    fmt = int(root.name.removeprefix("format-"))
    per_layer: list[list[Snapshot]] = [[] for _ in config["layers"]]
    for k, spec in enumerate(config["records"]):
        data = (root / f"record-{k}{GOLDEN_RECORD_SUFFIX}").read_bytes()
        numpy_views = decode_record(data)
        in_mlx = decode_record_to_mlx(data)
        assert numpy_views.header.format == fmt, f"record-{k}: format {numpy_views.header.format}"
        assert dict(numpy_views.header.meta) == spec["meta"], f"record-{k}: meta"
        want = [
            None
            if layer is None
            else Snapshot(
                layer["signature"],
                layer.get("start", spec["start"]),  # a recurrent checkpoint: its one position
                layer.get("stop", spec["stop"]),
                {n: expected[f"record.{k}.layer.{i}.{n}"] for n in layer["tensors"]},
                layer["meta"],
            )
            for i, layer in enumerate(spec["layers"])
        ]
        assert_snapshots_equal(want, numpy_views.layers)
        assert_snapshots_equal(want, in_mlx.layers)
        again = decode_record(encode_record(numpy_views.layers, meta=numpy_views.header.meta))
        assert_snapshots_equal(want, again.layers)  # today's writer re-writes what it reads
        for i, snap in enumerate(numpy_views.layers):
            if snap is not None:
                per_layer[i].append(snap)
    for i, layer in enumerate(config["layers"]):
        cache = restore(per_layer[i])
        held = []
        for j, (a, b, meta, *names) in enumerate(layer["held"]):
            # Fixtures before TurboQuant name one tensor list per layer.
            tensors = names[0] if names else layer["tensors"]
            arrays = {n: expected[f"held.layer.{i}.{j}.{n}"] for n in tensors}
            held.append(Snapshot(layer["signature"], a, b, arrays, meta))
        assert_snapshots_equal(held, snapshot_held(cache))
