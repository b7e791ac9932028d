"""Model fingerprints and namespaces: content-addressed, cached, equal across processes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
import xxhash

from kvstore.bridge import fingerprint as F
from kvstore.errors import CapabilityError, StoreConfigError
from kvstore.store import model_fingerprint, namespace_for
from kvstore.testing.mlx_lm_models import build_mlx_lm_model

PYCODE = Path("/work/shared/fixtures/pycode-lm")
if not PYCODE.is_dir():
    PYCODE = Path(__file__).resolve().parents[2] / "fixtures" / "pycode-lm"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSTORE_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture
def model_dir(tmp_path):
    if not PYCODE.is_dir():
        pytest.fail(f"the pycode-lm fixture is missing at {PYCODE}")
    return Path(shutil.copytree(PYCODE, tmp_path / "pycode-lm"))


def flip_weight_byte(model_dir: Path) -> None:
    shard = sorted(model_dir.glob("*.safetensors"))[-1]
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0x01  # inside the tensor data, after the header
    shard.write_bytes(bytes(data))


def test_a_directory_fingerprint_is_stable_and_location_free(model_dir, tmp_path):
    fp = model_fingerprint(model_dir)
    assert len(fp) == 64 and int(fp, 16) >= 0
    assert model_fingerprint(str(model_dir)) == fp
    elsewhere = shutil.copytree(model_dir, tmp_path / "copy")  # another host, another path
    assert model_fingerprint(elsewhere) == fp


def test_different_weights_give_a_different_fingerprint(model_dir):
    before = model_fingerprint(model_dir)
    flip_weight_byte(model_dir)
    assert model_fingerprint(model_dir) != before


def test_config_and_tokenizer_are_part_of_it(model_dir):
    before = model_fingerprint(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps(config, indent=7))  # formatting only
    assert model_fingerprint(model_dir) == before
    config["rope_theta"] = 20000.0
    (model_dir / "config.json").write_text(json.dumps(config))
    changed = model_fingerprint(model_dir)
    assert changed != before
    (model_dir / "tokenizer.json").write_text('{"model": {"vocab": {}}}')
    assert model_fingerprint(model_dir) != changed


def test_repeats_are_served_from_the_digest_cache(model_dir, monkeypatch):
    fp = model_fingerprint(model_dir)
    assert F.digest_cache_path().is_file()
    hashed = []
    real = F._hash_file
    monkeypatch.setattr(F, "_hash_file", lambda p: hashed.append(p) or real(p))
    assert model_fingerprint(model_dir) == fp
    assert hashed == []  # no weight file was read again
    flip_weight_byte(model_dir)  # new mtime: that file (only) is hashed again
    model_fingerprint(model_dir)
    assert [p.name for p in hashed] == [sorted(model_dir.glob("*.safetensors"))[-1].name]


def test_digests_cached_ahead_leave_the_fingerprint_nothing_to_hash(model_dir, monkeypatch):
    F.cache_directory_digests(model_dir)  # what kvstore serve runs beside mlx-lm's load
    hashed = []
    real = F._hash_file
    monkeypatch.setattr(F, "_hash_file", lambda p: hashed.append(p) or real(p))
    fp = model_fingerprint(model_dir)
    assert hashed == []
    monkeypatch.setattr(F, "_hash_file", real)
    F.digest_cache_path().unlink()
    assert model_fingerprint(model_dir) == fp  # the same fingerprint, hashed afresh
    # What cannot be hashed is left for the fingerprint to raise.
    F.cache_directory_digests(model_dir / "missing")
    with pytest.raises(StoreConfigError, match="is not a directory"):
        model_fingerprint(model_dir / "missing")


def test_another_process_with_no_setup_agrees(model_dir, tmp_path):
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path / "fresh-home")}
    code = (
        "import sys; from kvstore.store import model_fingerprint; "
        "print(model_fingerprint(sys.argv[1]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(model_dir)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == model_fingerprint(model_dir)


def test_mlx_lm_models():
    a = model_fingerprint(build_mlx_lm_model("llama", seed=1))
    assert model_fingerprint(build_mlx_lm_model("llama", seed=1)) == a
    assert model_fingerprint(build_mlx_lm_model("llama", seed=2)) != a  # same args, other weights
    assert model_fingerprint(build_mlx_lm_model("llama", seed=1, rope_theta=500.0)) != a
    assert model_fingerprint(build_mlx_lm_model("qwen3", seed=1)) != a
    bf16 = build_mlx_lm_model("llama", seed=1)
    bf16.set_dtype(mx.bfloat16)
    assert model_fingerprint(bf16) != a


class ReferenceModel(nn.Module):
    """Stands in for kvstore.model.Model: config, source_path, layer_layout(), parameters."""

    def __init__(self, source_path=None, seed=0):
        super().__init__()
        self._config = {"model_type": "llama", "hidden_size": 8}
        self.source_path = source_path
        self.proj = nn.Linear(8, 8, bias=False)
        self.proj.weight = mx.random.normal((8, 8), key=mx.random.key(seed))

    @property
    def config(self):
        return self._config

    def layer_layout(self):
        return [{"n_kv_heads": 2, "head_dim": 4, "sliding_window": None}]


def test_reference_models(model_dir):
    assert model_fingerprint(ReferenceModel(source_path=model_dir)) == model_fingerprint(model_dir)
    a = model_fingerprint(ReferenceModel(seed=1))
    assert model_fingerprint(ReferenceModel(seed=1)) == a
    assert model_fingerprint(ReferenceModel(seed=2)) != a


def test_a_tokenizer_can_join_an_object_fingerprint(model_dir):
    model = build_mlx_lm_model("llama", seed=1)
    plain = model_fingerprint(model)

    class Tok:
        def get_vocab(self):
            return {"a": 0, "b": 1}

    assert model_fingerprint(model, tokenizer=Tok()) not in (plain, None)
    with pytest.raises(CapabilityError, match="tokenizer of type int"):
        model_fingerprint(model, tokenizer=3)


def test_what_cannot_be_fingerprinted(tmp_path, model_dir):
    with pytest.raises(StoreConfigError, match="no config.json"):
        model_fingerprint(tmp_path)
    for shard in model_dir.glob("*.safetensors"):
        shard.unlink()
    with pytest.raises(StoreConfigError, match="no weight files .* would collide"):
        model_fingerprint(model_dir)
    with pytest.raises(CapabilityError, match="Cannot fingerprint a dict"):
        model_fingerprint({"model_type": "llama"})


def test_namespaces():
    fp = "ab" * 32
    layout = [{"n_kv_heads": 2, "head_dim": 64, "sliding_window": None}] * 2
    ns = namespace_for(fp, layout)
    assert len(ns) == 16 and int(ns, 16) >= 0 and ns == namespace_for(fp, tuple(layout))
    assert namespace_for("cd" * 32, layout) != ns
    assert namespace_for(fp, layout[:1]) != ns
    windowed = [{**layout[0], "sliding_window": 1024}, layout[1]]
    assert namespace_for(fp, windowed) != ns
    assert namespace_for(fp, layout, tenant="acme") not in (ns, namespace_for(fp, layout, "other"))
    with pytest.raises(StoreConfigError, match="layer_layout must be JSON-serialisable"):
        namespace_for(fp, [object()])
    with pytest.raises(StoreConfigError, match="fingerprint must be a non-empty str"):
        namespace_for("", layout)


# -- row digests (kvstore.bridge.digests) -------------------------------------------------


def _fake_kernel(*, inputs, output_shapes, output_dtypes, grid, threadgroup):
    """What the CUDA kernel computes, on the host: (lo, hi) of each zero-padded row."""
    import xxhash

    from kvstore.bridge.digests import ROW_BYTES

    params, flat = inputs
    n = int(np.asarray(params)[0])
    data = np.asarray(flat).tobytes()[:n]
    words = []
    for start in range(0, max(n, 1), ROW_BYTES):
        row = data[start : start + ROW_BYTES].ljust(ROW_BYTES, b"\0")
        value = xxhash.xxh3_128_intdigest(row)
        words += [value & (2**64 - 1), value >> 64]
    out = mx.array(np.array(words, np.uint64))
    assert tuple(out.shape) == tuple(output_shapes[0])
    return [out]


def test_row_digests_follow_their_definition_on_every_path():
    import xxhash

    from kvstore.bridge import digests

    rng = np.random.default_rng(1)
    arrays = [
        mx.array(rng.integers(0, 256, n, dtype=np.uint8)) for n in (1, digests.ROW_BYTES, 2**21 + 3)
    ]
    arrays.append(mx.array(rng.standard_normal((3, 5)).astype(np.float32)).astype(mx.bfloat16))
    want = []
    for a in arrays:
        data = np.asarray(a.view(mx.uint8) if a.dtype == mx.bfloat16 else a).tobytes()
        rows = [
            xxhash.xxh3_128_digest(data[i : i + digests.ROW_BYTES].ljust(digests.ROW_BYTES, b"\0"))
            for i in range(0, max(len(data), 1), digests.ROW_BYTES)
        ]
        want.append(xxhash.xxh3_128_hexdigest(b"".join(rows)))
    assert digests.array_digests(arrays) == want  # on the host, every core
    assert digests._device_digests(_fake_kernel, arrays) == want  # as the kernel's output is read


def test_a_large_array_is_hashed_in_launches_of_whole_rows(monkeypatch):
    # MLX aborts the process on a kernel input of 2**31 bytes (H100, both kernel routes):
    # an array past LAUNCH_BYTES goes in parts of whole rows, same digest.
    from kvstore.bridge import digests

    rng = np.random.default_rng(2)
    arrays = [
        mx.array(rng.integers(0, 256, 5 * digests.ROW_BYTES + 7, dtype=np.uint8)),
        mx.array(rng.standard_normal(3 * digests.ROW_BYTES // 2 + 1).astype(np.float32)).astype(
            mx.bfloat16
        ),
    ]
    want = digests._device_digests(_fake_kernel, arrays)
    launches = []

    def counted(**kwargs):
        launches.append(int(kwargs["inputs"][1].size))
        return _fake_kernel(**kwargs)

    monkeypatch.setattr(digests, "LAUNCH_BYTES", 2 * digests.ROW_BYTES)
    assert digests._device_digests(counted, arrays) == want
    row = digests.ROW_BYTES
    assert launches == [2 * row, 2 * row, row + 7, 2 * row, row + 2]


def test_the_digest_kernel_is_checked_before_it_is_trusted_and_never_deadlocks(monkeypatch):
    import threading

    from kvstore.bridge import digests

    assert digests.checked_kernel(_fake_kernel) is _fake_kernel

    def wrong(**kw):
        (out,) = _fake_kernel(**kw)
        return [out + mx.array(1, mx.uint64)]

    assert digests.checked_kernel(wrong) is False
    # The GPU branch of _kernel(), with the fake compiled: it must come back (the lock).
    monkeypatch.setattr(digests, "_KERNEL", None)
    monkeypatch.setattr(digests, "_build_kernel", lambda: _fake_kernel)
    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)
    monkeypatch.setattr(mx, "default_device", lambda: mx.gpu)
    found = []
    worker = threading.Thread(target=lambda: found.append(digests._kernel()), daemon=True)
    worker.start()
    worker.join(60)
    assert found == [_fake_kernel]


def test_a_file_digest_is_xxh3_128_of_its_bytes(tmp_path):
    data = np.random.default_rng(3).integers(0, 256, (3 << 20) + 5, dtype=np.uint8).tobytes()
    for name, content in (("weights.safetensors", data), ("empty.safetensors", b"")):
        path = tmp_path / name
        path.write_bytes(content)
        assert F.file_digest(path) == xxhash.xxh3_128_hexdigest(content)
