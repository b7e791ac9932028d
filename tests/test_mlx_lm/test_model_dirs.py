"""``write_model_dir``: the directories the tests and benches load with mlx-lm."""

from __future__ import annotations

import mlx.core as mx
import pytest

pytest.importorskip("mlx_lm")

from kvstore.testing.mlx_lm_models import write_model_dir  # noqa: E402


def test_weights_stored_in_the_type_asked_for_and_loaded_as_such(tmp_path):
    import mlx_lm
    from mlx.utils import tree_flatten

    plain = write_model_dir(tmp_path / "f32", "llama")
    half = write_model_dir(tmp_path / "bf16", "llama", dtype="bfloat16")
    stored = mx.load(str(half / "model.safetensors"))
    assert {v.dtype for v in stored.values()} == {mx.bfloat16}
    want = mx.load(str(plain / "model.safetensors"))
    assert stored.keys() == want.keys()
    for name, value in want.items():  # the same weights, rounded
        assert mx.array_equal(stored[name], value.astype(mx.bfloat16)), name

    model, _ = mlx_lm.load(str(half))
    assert {v.dtype for _, v in tree_flatten(model.parameters())} == {mx.bfloat16}


def test_sharded_weights_load_as_the_single_file_does(tmp_path):
    import mlx_lm

    from kvstore.bridge.fingerprint import mlx_lm_fingerprint

    whole = write_model_dir(tmp_path / "whole", "llama")
    sharded = write_model_dir(tmp_path / "sharded", "llama", shard_bytes=64 << 10)
    files = sorted(p.name for p in sharded.glob("*.safetensors"))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert (sharded / "model.safetensors.index.json").is_file()
    tokens = mx.array([[1, 2, 3, 4]])
    outputs = [mlx_lm.load(str(d))[0](tokens) for d in (whole, sharded)]
    assert mx.array_equal(*outputs)
    # The same model: the same fingerprint for mlx-lm's loads of both directories.
    assert mlx_lm_fingerprint(whole) == mlx_lm_fingerprint(sharded)
