"""Issue 17, item 1: a cache policy names a family per layer (index, kind, default)."""

import mlx.core as mx
import pytest

from kvstore.abc.cache import signature_string
from kvstore.errors import CapabilityError, UnknownSignatureError
from kvstore.layout import LayerLayout
from kvstore.model import CachePolicy, build_model, generate_tokens
from kvstore.store import namespace_for_model

from .conftest import prompt_tokens


@pytest.fixture(scope="module")
def gemma():
    return build_model("tiny-gemma3")  # layers 0 and 1 slide over 32 tokens, layer 2 is global


def families(model, policy):
    return [signature_string(c) for c in model.make_cache(policy)]


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        (
            CachePolicy(kv_bits=4, layout={"sliding": "kv:quant:8:64"}),
            ["kv:rotating-quant:8:64", "kv:rotating-quant:8:64", "kv:quant:4:64"],
        ),
        (
            CachePolicy(layout="default=kv:turboquant:3:3;2=kv:plain"),
            ["kv:rotating-turboquant:3:3", "kv:rotating-turboquant:3:3", "kv:plain"],
        ),
        (
            CachePolicy(family="kv:quant:8:64", layout="1=kv:quant:4:32;global=kv:turboquant:4:4"),
            ["kv:rotating-quant:8:64", "kv:rotating-quant:4:32", "kv:turboquant:4:4"],
        ),
        (
            CachePolicy(layout=LayerLayout(layers=((0, "kv:quant:2:64"),))),
            ["kv:rotating-quant:2:64", "kv:rotating-plain", "kv:plain"],
        ),
    ],
)
def test_each_layer_gets_the_family_named_for_its_index_then_its_kind_then_the_default(
    gemma, policy, expected
):
    assert families(gemma, policy) == expected


def test_a_layout_in_any_form_is_one_policy(gemma):
    text = CachePolicy(layout="default=kv:quant:4:64;sliding=kv:quant:8:64")
    as_dict = CachePolicy(layout={"sliding": "kv:quant:8:64", "default": "kv:quant:4:64"})
    as_fields = CachePolicy(kv_bits=4, layout={"sliding": "kv:quant:8:64"})
    assert text == as_dict
    assert families(gemma, text) == families(gemma, as_fields)
    assert text.to_layout() == as_fields.to_layout()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"kv_bits": 4, "layout": "default=kv:plain"}, ValueError, "exclusive"),
        ({"layout": "sliding=kv:rotating-plain"}, ValueError, "growing family"),
        ({"layout": "0=kv:rotating-quant:4:64"}, ValueError, "growing family"),
        ({"layout": "recurrent=kv:plain"}, ValueError, "recurrent state"),
        ({"layout": "0=kv:made-up:1"}, UnknownSignatureError, "Registered"),
        ({"layout": "0=kv:quant:7:64"}, ValueError, "bits must be one of"),
        ({"layout": "middle=kv:plain"}, ValueError, "by index or range"),
    ],
)
def test_a_layout_is_validated_against_the_registry(kwargs, error, match):
    with pytest.raises(error, match=match):
        CachePolicy(**kwargs)


def test_what_only_the_model_can_check_fails_when_its_caches_are_made(gemma):
    with pytest.raises(CapabilityError, match="names layer 5; the model has 3 layers"):
        gemma.make_cache(CachePolicy(layout="5=kv:plain"))
    with pytest.raises(CapabilityError, match="does not divide head_dim 64 of layer 2"):
        gemma.make_cache(CachePolicy(layout="2=kv:quant:4:128"))


def test_a_policy_round_trips_through_a_layout_file(tmp_path, gemma):
    policy = CachePolicy(kv_bits=8, keep=2, layout="0=kv:turboquant:3:4")
    path = policy.to_file(tmp_path / "layout.json", note="by hand")
    again = CachePolicy.from_file(path)
    assert again.keep == 2
    assert families(gemma, again) == families(gemma, policy)
    assert again.to_layout() == policy.to_layout()


def test_the_namespace_follows_each_layers_family(gemma):
    ns = {
        namespace_for_model(gemma, policy=CachePolicy(layout=text))
        for text in ("default=kv:quant:4:64", "2=kv:quant:8:64", "0=kv:quant:8:64")
    }
    assert len(ns) == 3
    by_kind = CachePolicy(kv_bits=4, layout="sliding=kv:quant:8:64")
    by_index = CachePolicy(kv_bits=4, layout="0-1=kv:quant:8:64")
    assert namespace_for_model(gemma, policy=by_kind) == namespace_for_model(gemma, policy=by_index)


def test_generate_runs_a_per_layer_policy(gemma):
    policy = CachePolicy(layout="default=kv:quant:4:64;sliding=kv:turboquant:4:4")
    prompt = prompt_tokens(n=40, vocab=gemma.args.vocab_size)
    tokens, stats = generate_tokens(gemma, prompt, max_tokens=4, policy=policy)
    assert len(tokens) == 4 and stats.prompt_tokens == 40
    caches = gemma.make_cache(policy)
    logits = gemma(mx.array(prompt)[None], cache=caches)
    assert mx.argmax(logits[0, -1]).item() == tokens[0]
