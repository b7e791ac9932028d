"""namespace_for_model, storage policies and Match.truncated: the small parts of save/restore."""

from __future__ import annotations

import json

import pytest

from kvstore.abc.store import BlockRef, Match
from kvstore.bridge.namespace import cache_layout
from kvstore.errors import ModelLoadError, StoreConfigError
from kvstore.model import CachePolicy, build_model, load_model
from kvstore.store import namespace_for_model
from kvstore.store.kv.policy import stored_signature

from ..test_model.conftest import save_mlx_lm_dir


def test_the_same_model_and_caches_give_the_same_namespace():
    a, b = build_model("tiny", seed=0), build_model("tiny", seed=0)
    assert namespace_for_model(a) == namespace_for_model(b)
    assert namespace_for_model(a) == namespace_for_model(a, caches=a.make_cache())


def test_weights_cache_families_windows_and_tenants_each_change_the_namespace():
    model = build_model("tiny", seed=0)
    names = {
        namespace_for_model(model),
        namespace_for_model(build_model("tiny", seed=1)),
        namespace_for_model(model, policy=CachePolicy(kv_bits=8)),
        namespace_for_model(model, policy=CachePolicy(kv_bits=4)),
        namespace_for_model(model, tenant="acme"),
    }
    assert len(names) == 5
    gemma = build_model("tiny-gemma3", seed=0)
    assert namespace_for_model(gemma) != namespace_for_model(gemma, policy=CachePolicy(keep=4))


def test_a_directory_and_the_model_loaded_from_it_share_a_namespace(tmp_path):
    model = build_model("tiny-gemma3", seed=3)
    path = save_mlx_lm_dir(tmp_path / "m", model, model.config)
    loaded, _ = load_model(path)
    policy = CachePolicy(kv_bits=8)
    assert namespace_for_model(path) == namespace_for_model(loaded)
    assert namespace_for_model(str(path), policy=policy) == namespace_for_model(
        loaded, policy=policy
    )


def test_an_mlx_lm_model_gets_a_namespace_from_its_own_caches():
    pytest.importorskip("mlx_lm")
    from kvstore.testing.mlx_lm_models import build_mlx_lm_model

    model = build_mlx_lm_model("llama", seed=0)
    ns = namespace_for_model(model)
    assert ns == namespace_for_model(model) and len(ns) == 16
    with pytest.raises(StoreConfigError, match="cache policy applies to kvstore models"):
        namespace_for_model(model, policy=CachePolicy(kv_bits=8))


def test_namespace_errors_say_what_to_pass(tmp_path):
    model = build_model("tiny", seed=0)
    with pytest.raises(StoreConfigError, match="policy or caches, not both"):
        namespace_for_model(model, policy=CachePolicy(), caches=model.make_cache())
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text(json.dumps({"model_type": "llama"}) + "{")
    with pytest.raises(ModelLoadError, match="not readable JSON"):
        namespace_for_model(tmp_path / "bad")


def test_cache_layout_names_families_and_windows():
    caches = build_model("tiny-gemma3", seed=0).make_cache(CachePolicy(kv_bits=8, keep=2))
    assert cache_layout(caches) == [
        {"cache": "kv:rotating-quant:8:64", "window": [32, 2]},
        {"cache": "kv:rotating-quant:8:64", "window": [32, 2]},
        {"cache": "kv:quant:8:64"},
    ]


@pytest.mark.parametrize(
    ("family", "policy", "stored"),
    [
        ("kv:plain", "lossless", "kv:plain"),
        ("kv:rotating-plain", "lossless", "kv:rotating-plain"),
        ("kv:plain", "kv:quant:8:64", "kv:quant:8:64"),
        ("kv:rotating-plain", "kv:quant:4:64", "kv:rotating-quant:4:64"),
        ("kv:plain", "kv:turboquant:3:3", "kv:turboquant:3:3"),
        ("kv:rotating-plain", "kv:turboquant:2:2", "kv:rotating-turboquant:2:2"),
        ("kv:quant:4:64", "kv:quant:8:64", "kv:quant:4:64"),  # never re-encoded
        ("kv:rotating-quant:8:32", "kv:turboquant:3:3", "kv:rotating-quant:8:32"),
    ],
)
def test_a_storage_policy_re_encodes_plain_layers_only(family, policy, stored):
    assert stored_signature(family, policy) == stored


def test_a_match_truncated_trims_its_last_block():
    blocks = tuple(BlockRef(bytes([i]), i, 16 * i, 16, 16) for i in range(3))
    match = Match("ns", 48, 60, 16, blocks)
    cut = match.truncated(37)
    assert cut.tokens == 37 and [(b.start, b.rows) for b in cut.blocks] == [
        (0, 16),
        (16, 16),
        (32, 5),
    ]
    assert match.truncated(32).blocks == blocks[:2]
    assert match.truncated(0).blocks == ()
    assert match.truncated(48) == match  # nothing cut: the match as it is
    trimmed = match.truncated(37)
    assert trimmed.truncated(37) == trimmed and trimmed.blocks[-1].rows == 5
    with pytest.raises(ValueError, match=r"tokens must be in \[0, 48\]"):
        match.truncated(49)


@pytest.mark.parametrize(
    ("family", "index", "stored"),
    [
        ("kv:plain", 0, "kv:quant:4:64"),
        ("kv:plain", 2, "kv:plain"),  # lossless by index
        ("kv:rotating-plain", 1, "kv:rotating-quant:8:64"),  # sliding, by kind
        ("kv:plain", 7, "kv:turboquant:3:3"),  # the default
        ("kv:quant:4:32", 0, "kv:quant:4:32"),  # never re-encoded
    ],
)
def test_a_per_layer_storage_policy_picks_each_layers_encoding(family, index, stored):
    policy = "default=kv:turboquant:3:3;sliding=kv:quant:8:64;0=kv:quant:4:64;2=lossless"
    assert stored_signature(family, policy, index) == stored
    assert stored_signature(family, "2=kv:quant:8:64", 0) == family  # named nowhere: lossless


def test_a_cache_layout_becomes_the_storage_policy_storing_it():
    from kvstore.store.kv.policy import storage_policy_for

    assert storage_policy_for("default=kv:turboquant:3:3;1=kv:plain") == (
        "default=kv:turboquant:3:3;1=lossless"
    )
    assert storage_policy_for("kv:plain") == "lossless"
    assert storage_policy_for("default=kv:quant:8:64") == "kv:quant:8:64"
