"""The codec registry: explicit built-ins, entry-point plugins, misses, compatibility."""

import importlib
import inspect
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import kvstore
import kvstore.codecs
from kvstore.abc.cache import signature_of, uses_dense_attention
from kvstore.abc.codec import KVCodec
from kvstore.caches import (
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    RotatingQuantizedKVCache,
    RotatingTurboQuantKVCache,
    TurboQuantKVCache,
)
from kvstore.codecs import (
    PlainKVCodec,
    QuantizedKVCodec,
    RotatingKVCodec,
    RotatingQuantizedKVCodec,
    RotatingTurboQuantKVCodec,
    TurboQuantKVCodec,
    codec_for,
    get_codec,
    register_codec,
    registered_kinds,
    restore,
    snapshot,
)
from kvstore.codecs import registry as registry_module
from kvstore.errors import CapabilityError, UnknownSignatureError
from kvstore.testing.codec import check_continue, check_signature, fill_cache

PLUGIN_DIR = Path(__file__).parent.parent / "fixtures" / "plugin"


@pytest.fixture
def registry(registries_restored):
    """The registries' tables (codecs and families), restored after the test."""
    return registry_module


def all_codec_classes():
    for info in pkgutil.walk_packages(kvstore.__path__, "kvstore."):
        importlib.import_module(info.name)
    seen, todo = set(), [KVCodec]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in seen:
                seen.add(sub)
                todo.append(sub)
    # A codec is the codec of the family it names; bases that name none are shared code.
    return [
        c
        for c in seen
        if c.__module__.startswith("kvstore.")
        and not inspect.isabstract(c)
        and "family" in c.__dict__
    ]


def test_every_codec_class_is_registered():
    classes = all_codec_classes()
    assert {
        PlainKVCodec,
        QuantizedKVCodec,
        RotatingKVCodec,
        RotatingQuantizedKVCodec,
        TurboQuantKVCodec,
        RotatingTurboQuantKVCodec,
    } <= set(classes)
    unregistered = [c.__name__ for c in classes if registry_module._CODECS.get(c.kind) is not c]
    assert not unregistered, (
        f"codec classes not registered in kvstore/codecs/__init__.py: {unregistered}"
    )


def test_builtin_kinds():
    builtin = {
        "kv:plain",
        "kv:quant",
        "kv:rotating-plain",
        "kv:rotating-quant",
        "kv:turboquant",
        "kv:rotating-turboquant",
    }
    assert builtin <= set(registered_kinds())


@pytest.mark.parametrize(
    "signature",
    [
        "kv:plain",
        "kv:quant:4:64",
        "kv:quant:3:32",
        "kv:rotating-plain",
        "kv:rotating-quant:8:128",
        "kv:turboquant:4:3",
        "kv:rotating-turboquant:2:2",
    ],
)
def test_signatures_resolve_to_bound_codecs(signature):
    codec = check_signature(signature)
    assert get_codec(signature) is codec  # instances are cached per signature


def test_unknown_kind_lists_registered_kinds():
    with pytest.raises(UnknownSignatureError) as info:
        get_codec("kv:tq2:3")
    msg = str(info.value)
    assert msg.startswith("[codecs.get] Unknown signature kind 'kv:tq2'")
    assert "Registered: " + ", ".join(registered_kinds()) in msg
    assert info.value.found == "kv:tq2" and info.value.supported == registered_kinds()
    with pytest.raises(UnknownSignatureError, match=r"kind 'batch' \(in 'batch:kv:plain'\)"):
        get_codec("batch:kv:plain")  # a wrapper family has no codec: batches go row by row


def test_bad_parameters_of_a_known_kind_are_a_value_error():
    with pytest.raises(ValueError, match="bits must be one of"):
        get_codec("kv:quant:7:64")
    with pytest.raises(ValueError, match="kv:turboquant"):
        get_codec("kv:turboquant:6:4")


@pytest.mark.parametrize(
    "make, codec",
    [
        (KVCache, PlainKVCodec),
        (lambda: QuantizedKVCache(32, 5), QuantizedKVCodec),
        (lambda: RotatingKVCache(16, keep=2), RotatingKVCodec),
        (lambda: RotatingQuantizedKVCache(16, bits=4), RotatingQuantizedKVCodec),
        (lambda: TurboQuantKVCache(3, 2), TurboQuantKVCodec),
        (lambda: RotatingTurboQuantKVCache(16, kbits=2, vbits=4), RotatingTurboQuantKVCodec),
    ],
)
def test_codec_for_our_caches(make, codec):
    cache = make()
    assert type(codec_for(cache)) is codec
    assert codec_for(cache).signature == cache.signature()


def test_codec_for_mlx_lm_caches():
    lm = pytest.importorskip("mlx_lm.models.cache")
    assert type(codec_for(lm.KVCache())) is PlainKVCodec
    assert codec_for(lm.QuantizedKVCache(32, 8)).signature == "kv:quant:8:32"
    assert type(codec_for(lm.RotatingKVCache(8))) is RotatingKVCodec


def test_codec_for_unknown_caches_names_their_signature():
    class Odd:
        def signature(self):
            return "kv:bogus:1"

    with pytest.raises(CapabilityError, match="signature 'kv:bogus:1'") as info:
        codec_for(Odd())
    assert info.value.signature == "kv:bogus:1"
    with pytest.raises(CapabilityError, match="signature 'unknown'"):
        codec_for(object())


def test_a_kind_is_shared_only_by_codecs_that_read_each_other(registry):
    class PlainV2(PlainKVCodec):
        version = 2
        reads = frozenset({2})

    with pytest.raises(ValueError, match="each reads the other's output"):
        register_codec(PlainV2)

    class PlainV2ReadsBoth(PlainKVCodec):
        version = 2
        reads = frozenset({1, 2})

    with pytest.raises(ValueError, match="cannot also serve it"):
        register_codec(PlainV2ReadsBoth)  # PlainKVCodec does not read version 2

    class PlainCompatible(PlainKVCodec):
        pass

    assert register_codec(PlainCompatible) is PlainCompatible
    assert type(get_codec("kv:plain")) is PlainCompatible


def test_register_rejects_what_is_not_a_codec():
    with pytest.raises(TypeError, match="KVCodec subclass"):
        register_codec(dict)
    with pytest.raises(TypeError, match="KVCodec subclass"):
        register_codec(kvstore.codecs.GrowingKVCodec)  # abstract

    class NoFamily(PlainKVCodec):  # a codec that restates a kind but declares no family
        family = None  # type: ignore[assignment]
        kind = "kv:nofamily"

    with pytest.raises(TypeError, match="naming the Family it serves"):
        register_codec(NoFamily)


@pytest.fixture
def plugin_on_path(registry, monkeypatch):
    monkeypatch.syspath_prepend(str(PLUGIN_DIR))
    importlib.invalidate_caches()
    yield
    sys.modules.pop("plugin_pkg", None)


def test_plugin_codec_resolves_through_its_entry_point(plugin_on_path):
    assert "kv:example-plain" not in registered_kinds()
    codec = get_codec("kv:example-plain")
    assert type(codec).__name__ == "ExamplePlainKVCodec"
    assert type(codec).__module__ == "plugin_pkg"
    assert "kv:example-plain" in registered_kinds()
    # The plugin family works end to end: snapshot, restore, continue.
    cache = sys.modules["plugin_pkg"].ExampleKVCache()
    fill_cache(cache, [12, 1])
    assert codec_for(cache) is codec
    # Its family registered with its codec: the grammar and the predicates know it.
    assert str(signature_of(cache)) == "kv:example-plain" and uses_dense_attention(cache)
    again = restore(snapshot(cache))
    assert type(again).__name__ == "ExampleKVCache"
    check_continue(cache, again, [1, 3])


def test_a_plugin_family_is_found_by_parsing_its_signature(plugin_on_path):
    # No codec lookup first: the grammar's miss loads the entry point, codec and family.
    sig = kvstore.parse_signature("kv:example-plain")
    assert sig.family.description.startswith("raw rows")
    assert type(get_codec("kv:example-plain")).__module__ == "plugin_pkg"


def test_the_builtin_families_register_on_first_use_in_a_fresh_process():
    code = (
        "import sys; from kvstore.signature import parse_signature; "
        "print(parse_signature('kv:rotating-quant:4:64').family.window_of, "
        "'kvstore.codecs' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.split() == ["kv:quant", "True"]


def test_without_the_plugin_its_kind_is_unknown(registry):
    with pytest.raises(UnknownSignatureError, match="kv:example-plain"):
        get_codec("kv:example-plain")
