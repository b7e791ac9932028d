"""`.safetensors` snapshot files: layout, and what a reader refuses."""

import json

import mlx.core as mx
import pytest

from kvstore.caches import KVCache, QuantizedKVCache
from kvstore.codecs import snapshot
from kvstore.codecs.files import METADATA_KEY, load_snapshots, save_snapshots
from kvstore.errors import CorruptEntryError, FormatVersionError
from kvstore.testing.codec import assert_snapshots_equal, fill_cache


def layers():
    plain, quant = KVCache(), QuantizedKVCache(64, 8)
    for cache in (plain, quant):
        fill_cache(cache, [9], dtype=mx.bfloat16)
    return [snapshot(plain), None, snapshot(quant, 2, 7)]


def test_layout_is_plain_safetensors_with_one_json_header(tmp_path):
    path = str(tmp_path / "s.safetensors")
    save_snapshots(path, layers(), meta={"model": "tiny"})
    arrays, metadata = mx.load(path, return_metadata=True)
    assert set(metadata) == {METADATA_KEY}
    header = json.loads(metadata[METADATA_KEY])
    assert (
        header["format"] == 1
        and header["meta"] == {"model": "tiny"}
        and header["layers"][1] is None
    )
    assert sorted(arrays) == sorted(
        ["layer.0.keys", "layer.0.values"]
        + [f"layer.2.{s}.{p}" for s in ("keys", "values") for p in ("q", "scales", "biases")]
    )
    assert arrays["layer.0.keys"].dtype == mx.bfloat16
    loaded, meta = load_snapshots(path)
    assert meta == {"model": "tiny"}
    assert_snapshots_equal(layers(), loaded)


def rewrite(tmp_path, change):
    path = str(tmp_path / "s.safetensors")
    save_snapshots(path, layers())
    arrays, metadata = mx.load(path, return_metadata=True)
    header = json.loads(metadata[METADATA_KEY])
    arrays, header = change(arrays, header)
    mx.save_safetensors(path, arrays, metadata={METADATA_KEY: json.dumps(header)})
    return path


def test_newer_format_and_unknown_fields(tmp_path):
    path = rewrite(tmp_path, lambda a, h: (a, {**h, "format": 2}))
    with pytest.raises(FormatVersionError, match="Format 2 is newer"):
        load_snapshots(path)
    path = rewrite(tmp_path, lambda a, h: (a, {**h, "compression": "zstd"}))
    with pytest.raises(FormatVersionError, match="field 'compression'"):
        load_snapshots(path)


def test_header_and_tensors_must_agree(tmp_path):
    path = rewrite(tmp_path, lambda a, h: ({**a, "layer.0.keys": a["layer.0.keys"][:, :, :3]}, h))
    with pytest.raises(CorruptEntryError, match="'layer.0.keys' should be bfloat16"):
        load_snapshots(path)
    path = rewrite(tmp_path, lambda a, h: ({**a, "stray": mx.zeros(2)}, h))
    with pytest.raises(CorruptEntryError, match="does not describe: stray"):
        load_snapshots(path)


def test_files_that_are_not_snapshot_files(tmp_path):
    mx.save_safetensors(
        str(tmp_path / "w.safetensors"), {"w": mx.zeros(2)}, metadata={"1.0": "KVCache"}
    )
    with pytest.raises(CorruptEntryError, match="use import_prompt_cache"):
        load_snapshots(tmp_path / "w.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"\x00" * 20)
    with pytest.raises(CorruptEntryError, match="not a readable safetensors file"):
        load_snapshots(tmp_path / "junk.safetensors")
    path = str(tmp_path / "deep.safetensors")
    mx.save_safetensors(path, {}, metadata={METADATA_KEY: "[" * 100_000 + "]" * 100_000})
    with pytest.raises(CorruptEntryError):
        load_snapshots(path)


def test_meta_must_be_json(tmp_path):
    with pytest.raises(TypeError, match="not JSON-able"):
        save_snapshots(tmp_path / "x.safetensors", layers(), meta={"b": b"\x00"})
