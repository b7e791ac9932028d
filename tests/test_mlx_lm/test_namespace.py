"""Namespaces of models mlx-lm runs: any architecture, the object and its directory alike."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from kvstore.bridge import fingerprint as F
from kvstore.bridge.namespace import namespace_for_mlx_lm, namespace_for_model
from kvstore.errors import StoreConfigError


@pytest.mark.parametrize("arch", ["phi3", "qwen3_next"])
def test_an_architecture_the_reference_model_lacks_gets_a_namespace(arch, model_dirs, load):
    model, _ = load(arch)
    directory = model_dirs[arch]
    ns = namespace_for_model(directory)  # raised CapabilityError before issue 15
    assert len(ns) == 16
    assert ns == namespace_for_model(str(directory)) == namespace_for_model(model)
    assert ns == namespace_for_mlx_lm(directory) == namespace_for_mlx_lm(model)
    assert ns == namespace_for_mlx_lm(model, source=directory)


def test_what_changes_the_kv_changes_the_namespace(model_dirs, load):
    model, _ = load("llama")
    base = namespace_for_mlx_lm(model)
    variants = [
        namespace_for_mlx_lm(model, kv_bits=8),
        namespace_for_mlx_lm(model, kv_bits=4),
        namespace_for_mlx_lm(model, kv_bits=8, kv_group_size=32),
        namespace_for_mlx_lm(model, kv_bits=8, quantized_kv_start=0),
        namespace_for_mlx_lm(model, tenant="acme"),
        namespace_for_mlx_lm(load("qwen3")[0]),
    ]
    assert len({base, *variants}) == len(variants) + 1
    assert namespace_for_mlx_lm(model_dirs["llama"], kv_bits=8) == variants[0]
    # The reference model keeps its own namespace for the directories it runs.
    assert namespace_for_model(model_dirs["llama"]) != base


def write_adapters(model, path, seed: int):
    from mlx_lm.tuner.utils import linear_to_lora_layers

    keys = ["self_attn.q_proj", "self_attn.v_proj"]
    config = {"rank": 4, "scale": 2.0, "dropout": 0.0, "keys": keys}
    model.freeze()
    linear_to_lora_layers(model, 2, config)
    params = dict(tree_flatten(model.trainable_parameters()))
    mx.random.seed(seed)
    params = {k: mx.random.normal(v.shape) * 0.05 for k, v in params.items()}
    path.mkdir()
    mx.save_safetensors(str(path / "adapters.safetensors"), params)
    adapter_config = {"fine_tune_type": "lora", "num_layers": 2, "lora_parameters": config}
    (path / "adapter_config.json").write_text(json.dumps(adapter_config))


def test_adapters_are_part_of_it_for_the_object_and_the_directory(model_dirs, tmp_path):
    import mlx_lm

    directory = model_dirs["llama"]
    write_adapters(mlx_lm.load(str(directory))[0], tmp_path / "a1", seed=1)
    write_adapters(mlx_lm.load(str(directory))[0], tmp_path / "a2", seed=2)
    plain = namespace_for_mlx_lm(directory)
    with_a1 = namespace_for_mlx_lm(directory, adapter_path=tmp_path / "a1")
    with_a2 = namespace_for_mlx_lm(directory, adapter_path=tmp_path / "a2")
    assert len({plain, with_a1, with_a2}) == 3
    adapted, _ = mlx_lm.load(str(directory), adapter_path=str(tmp_path / "a1"))
    assert namespace_for_mlx_lm(adapted) == with_a1
    assert namespace_for_mlx_lm(adapted, source=directory, adapter_path=tmp_path / "a1") == with_a1
    with pytest.raises(StoreConfigError, match="already holds its adapters"):
        namespace_for_mlx_lm(adapted, adapter_path=tmp_path / "a1")
    with pytest.raises(StoreConfigError, match="not a directory of adapter files"):
        namespace_for_mlx_lm(directory, adapter_path=tmp_path / "none")


def test_a_directory_is_loaded_once_then_served_from_the_digest_cache(model_dirs, monkeypatch):
    directory = model_dirs["phi3"]
    ns = namespace_for_mlx_lm(directory)

    def no_load(*args):
        raise AssertionError("the model was loaded again")

    monkeypatch.setattr(F, "_load_lazily", no_load)
    assert namespace_for_mlx_lm(directory) == ns
