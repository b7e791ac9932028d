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
