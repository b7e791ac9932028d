"""Acceptance 5: mlx-lm prompt-cache files both ways, against the installed mlx-lm
and files written by a real mlx-lm 0.28.0 and 0.31.3 (the legacy layout, two kinds of
``meta_state``: tools/write_mlx_lm_fixture.py)."""

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

pytest.importorskip("mlx_lm")
from mlx_lm.models import cache as lm_cache  # noqa: E402

from kvstore.caches import (  # noqa: E402
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    RotatingQuantizedKVCache,
)
from kvstore.codecs import snapshot_held  # noqa: E402
from kvstore.codecs.prompt_cache import (  # noqa: E402
    export_prompt_cache,
    import_prompt_cache,
    installed_file_layout,
)
from kvstore.errors import CapabilityError, CorruptEntryError  # noqa: E402
from kvstore.testing.codec import (  # noqa: E402
    assert_arrays_equal,
    assert_snapshots_equal,
    check_continue,
    fill_cache,
)
from kvstore.testing.mlx_lm_models import build_mlx_lm_model  # noqa: E402
from tests.markers import needs_tested_mlx_lm

FIXTURES = Path(__file__).parent.parent / "fixtures" / "mlx_lm"

# (ours, stock mlx-lm) pairs fed the same rows
PAIRS = {
    "plain": (KVCache, lm_cache.KVCache),
    "quant-4-64": (lambda: QuantizedKVCache(64, 4), lambda: lm_cache.QuantizedKVCache(64, 4)),
    "quant-8-32": (lambda: QuantizedKVCache(32, 8), lambda: lm_cache.QuantizedKVCache(32, 8)),
    "rotating": (lambda: RotatingKVCache(16, keep=2), lambda: lm_cache.RotatingKVCache(16, keep=2)),
}
HISTORY = [30, 1, 1, 5, 1, 1]


@needs_tested_mlx_lm
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16], ids=["fp16", "bf16"])
def test_import_current_layout_written_by_stock_mlx_lm(tmp_path, dtype):
    ours = [make() for make, _ in PAIRS.values()]
    theirs = [make() for _, make in PAIRS.values()]
    for cache in ours + theirs:
        fill_cache(cache, HISTORY, dtype=dtype)
    path = tmp_path / "stock.safetensors"
    lm_cache.save_prompt_cache(str(path), theirs, {"model": "tiny"})
    imported = import_prompt_cache(path)
    assert imported.layout == "current" and imported.metadata == {"model": "tiny"}
    for mine, layer in zip(ours, imported.layers, strict=True):
        # Capacity padding is gone: the snapshots hold exactly the logical rows.
        assert_snapshots_equal(snapshot_held(mine), layer)
    for stock, restored in zip(theirs, imported.caches(), strict=True):
        check_continue(stock, restored, [1, 1, 7, 1], dtype=dtype)


def fixture_caches(version: str) -> tuple[dict, list]:
    """The config of the fixture mlx-lm ``version`` wrote and kvstore's caches fed the
    same rows."""
    config = json.loads((FIXTURES / f"config-mlx-lm-{version}.json").read_text())
    inputs = mx.load(str(FIXTURES / f"inputs-mlx-lm-{version}.safetensors"))
    ours_by_class = {
        "KVCache": KVCache,
        "QuantizedKVCache": QuantizedKVCache,
        "RotatingKVCache": RotatingKVCache,
    }
    caches = []
    for i, spec in enumerate(config["layers"]):
        mine = ours_by_class[spec["class"]](*spec["args"])
        for j in range(len(spec["updates"])):
            mine.update_and_fetch(
                inputs[f"layer.{i}.update.{j}.keys"], inputs[f"layer.{i}.update.{j}.values"]
            )
        caches.append(mine)
    return config, caches


@pytest.mark.parametrize("version", ["0.28.0", "0.31.3"])
def test_import_legacy_layout_written_by_real_mlx_lm(version):
    # 0.28.0's meta_state fields begin with the cache's step, 0.31.3's do not.
    config, ours = fixture_caches(version)
    imported = import_prompt_cache(FIXTURES / f"prompt-cache-mlx-lm-{version}.safetensors")
    assert imported.layout == "legacy"
    assert imported.metadata == {"written_by": f"mlx-lm {version}"}
    restored = imported.caches()
    for i, (spec, layer) in enumerate(zip(config["layers"], imported.layers, strict=True)):
        assert_snapshots_equal(snapshot_held(ours[i]), layer)
        check_continue(ours[i], restored[i], [1, 1, 7, 1], dtype=getattr(mx, spec["dtype"]))
    # the rotated ring kept its rotation
    assert imported.layers[2][0].meta["ring_idx"] == 6


def test_legacy_export_is_the_file_mlx_lm_0_31_wrote(tmp_path):
    _, ours = fixture_caches("0.31.3")
    path = tmp_path / "legacy.safetensors"
    export_prompt_cache(path, ours, {"written_by": "mlx-lm 0.31.3"}, layout="legacy")
    got, got_meta = mx.load(str(path), return_metadata=True)
    want, want_meta = mx.load(
        str(FIXTURES / "prompt-cache-mlx-lm-0.31.3.safetensors"), return_metadata=True
    )
    assert sorted(got) == sorted(want)
    # The last layer is a window of 16 after a 12-token chunk: mlx-lm 0.31 keeps the
    # chunk's whole buffer (22 rows, the next write at 22); the export holds the window
    # those rows end in (16 rows, the next write at 16), as the current layout's does.
    # Everything else is what mlx-lm wrote, tensor for tensor and string for string.
    window = {"3.0", "3.1"}
    for name in sorted(set(want) - window):
        assert_arrays_equal(want[name], got[name], name)
    for name in window:
        assert_arrays_equal(want[name][..., -16:, :], got[name], name)
    assert (want_meta.pop("0.3.3"), got_meta.pop("0.3.3")) == ("22", "16")
    assert got_meta == want_meta


def test_legacy_export_round_trips_through_import(tmp_path):
    ours = [make() for make, _ in PAIRS.values()]
    for cache in ours:
        fill_cache(cache, HISTORY, dtype=mx.bfloat16)
    export_prompt_cache(tmp_path / "x.safetensors", ours, {"a": "b"}, layout="legacy")
    imported = import_prompt_cache(tmp_path / "x.safetensors")
    assert imported.layout == "legacy" and imported.metadata == {"a": "b"}
    for mine, layer in zip(ours, imported.layers, strict=True):
        assert_snapshots_equal(snapshot_held(mine), layer)


@pytest.mark.parametrize(
    ("version", "layout"),
    [
        (None, "current"),
        ("0.28.4", "legacy"),
        ("0.30.7", "legacy"),
        ("0.31.3", "legacy"),
        ("0.32.0", "current"),
        ("0.32.2", "current"),
        ("1.0.0", "current"),
    ],
)
def test_the_installed_mlx_lm_s_layout_comes_from_its_metadata(monkeypatch, version, layout):
    from importlib import metadata

    def installed(name: str) -> str:
        assert name == "mlx-lm"
        if version is None:
            raise metadata.PackageNotFoundError(name)
        return version

    monkeypatch.setattr(metadata, "version", installed)
    assert installed_file_layout() == layout


def test_the_installed_layout_is_read_without_importing_the_integration():
    # mlx-lm 0.28-0.30 lack what kvstore.mlx_lm imports (LRUPromptCache, ...): the layout
    # auto picks must not depend on it. Here mlx_lm cannot be imported at all.
    code = (
        "import sys; sys.modules['mlx_lm'] = None\n"
        "from kvstore.codecs.prompt_cache import installed_file_layout\n"
        "import kvstore.cli.export_cache\n"
        "print(installed_file_layout())\n"
        "assert 'kvstore.mlx_lm' not in sys.modules, 'the integration was imported'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() in ("current", "legacy")


def test_export_of_an_unknown_layout_is_refused(tmp_path):
    cache = KVCache()
    fill_cache(cache, [3])
    with pytest.raises(ValueError, match="layout is one of current, legacy; received 'v0.30'"):
        export_prompt_cache(tmp_path / "x.safetensors", [cache], layout="v0.30")
    assert not (tmp_path / "x.safetensors").exists()


def logits_after(model, caches, chunks, seed=5):
    out = []
    for n in chunks:
        out.append(model(mx.random.randint(0, 256, (1, n), key=mx.random.key(seed)), cache=caches))
        seed += 1
    mx.eval(out)
    return out


@pytest.mark.parametrize(
    "family",
    ["plain", "quant-4-64", "rotating"],
)
def test_export_loads_in_stock_mlx_lm_with_identical_logits(tmp_path, family):
    # In the layout the installed mlx-lm loads: the current one with mlx-lm 0.32, the
    # legacy one with 0.31 (Python 3.10).
    model = build_mlx_lm_model("llama")
    make = PAIRS[family][0]
    ours = [make() for _ in model.layers]
    prompt = mx.random.randint(0, 256, (1, 70), key=mx.random.key(3))
    model(prompt[:, :64], cache=ours)
    for i in range(64, 70):  # decode: a rotating window wraps and rotates
        model(prompt[:, i : i + 1], cache=ours)
    path = tmp_path / "ours.safetensors"
    export_prompt_cache(path, ours, {"source": "kvstore"}, layout=installed_file_layout())
    stock, metadata = lm_cache.load_prompt_cache(str(path), return_metadata=True)
    assert metadata == {"source": "kvstore"}
    assert [type(c) for c in stock] == [type(PAIRS[family][1]())] * len(ours)
    chunks = [1, 1, 6, 1]
    want_all, got_all = logits_after(model, ours, chunks), logits_after(model, stock, chunks)
    for want, got in zip(want_all, got_all, strict=True):
        assert_arrays_equal(want, got, "next-token logits")


def test_export_round_trips_through_import(tmp_path):
    ours = [make() for make, _ in PAIRS.values()]
    for cache in ours:
        fill_cache(cache, HISTORY, dtype=mx.bfloat16)
    export_prompt_cache(tmp_path / "x.safetensors", ours)
    imported = import_prompt_cache(tmp_path / "x.safetensors")
    for mine, layer in zip(ours, imported.layers, strict=True):
        assert_snapshots_equal(snapshot_held(mine), layer)


def test_export_of_a_family_mlx_lm_lacks_is_refused(tmp_path):
    ring = RotatingQuantizedKVCache(16, bits=4)
    fill_cache(ring, [3])
    with pytest.raises(CapabilityError, match="mlx-lm has no cache class") as info:
        export_prompt_cache(tmp_path / "x.safetensors", [ring])
    assert info.value.signature == "kv:rotating-quant:4:64"


def test_import_errors(tmp_path):
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CorruptEntryError, match="is not a readable safetensors file"):
        import_prompt_cache(tmp_path / "junk.safetensors")
    mx.save_safetensors(str(tmp_path / "plain.safetensors"), {"w": mx.zeros(3)})
    with pytest.raises(CorruptEntryError, match="No mlx-lm prompt-cache metadata"):
        import_prompt_cache(tmp_path / "plain.safetensors")
    chunked = lm_cache.ChunkedKVCache(8)
    chunked.update_and_fetch(mx.zeros((1, 1, 3, 32)), mx.zeros((1, 1, 3, 32)))
    lm_cache.save_prompt_cache(str(tmp_path / "chunked.safetensors"), [chunked])
    with pytest.raises(CapabilityError, match="ChunkedKVCache") as info:
        import_prompt_cache(tmp_path / "chunked.safetensors")
    assert info.value.found == "ChunkedKVCache"
