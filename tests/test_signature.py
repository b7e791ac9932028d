import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstore.errors import KVStoreError, UnknownSignatureError
from kvstore.family import Family, ParamSpec, register_family
from kvstore.signature import (
    Signature,
    format_signature,
    make_signature,
    parse_signature,
    registered_kinds,
)

VALID = [
    "kv:plain",
    "kv:rotating-plain",
    *(f"kv:quant:{b}:{g}" for b in (2, 3, 4, 5, 6, 8) for g in (32, 64, 128)),
    *(f"kv:rotating-quant:{b}:{g}" for b in (2, 3, 4, 5, 6, 8) for g in (32, 64, 128)),
    *(f"kv:turboquant:{k}:{v}" for k in (2, 3, 4, 5) for v in (2, 3, 4, 5)),
    *(f"kv:rotating-turboquant:{k}:{v}" for k in (2, 3, 4, 5) for v in (2, 3, 4, 5)),
]


@pytest.mark.parametrize("text", VALID)
def test_round_trip_exact(text):
    sig = parse_signature(text)
    assert format_signature(sig) == text
    assert str(sig) == text
    assert parse_signature(str(sig)) == sig


def test_parsed_fields():
    sig = parse_signature("kv:quant:4:64")
    assert (sig.kind, sig.params, sig.bits, sig.group_size) == ("kv:quant", (4, 64), 4, 64)
    tq = parse_signature("kv:turboquant:4:3")
    assert (tq.kind, tq.kbits, tq.vbits) == ("kv:turboquant", 4, 3)
    assert make_signature("kv:quant", 8, 32) == Signature("kv:quant", (8, 32))
    assert sig.family.kind == "kv:quant" and sig.param("group_size") == 64
    with pytest.raises(AttributeError, match="no parameter 'bits'"):
        _ = parse_signature("kv:plain").bits


@pytest.mark.parametrize(
    "text, allowed",
    [
        ("kv:quant:7:64", "2, 3, 4, 5, 6, 8"),
        ("kv:quant:4:48", "32, 64, 128"),
        ("kv:turboquant:6:3", "kbits must be one of 2, 3, 4, 5; received 6"),
        ("kv:turboquant:4:1", "vbits must be one of 2, 3, 4, 5; received 1"),
        ("kv:quant:04:64", "2, 3, 4, 5, 6, 8"),
        ("kv:quant:+4:64", "2, 3, 4, 5, 6, 8"),
        ("kv:quant:4:", "32, 64, 128"),
    ],
)
def test_bad_parameter_value_says_what_is_allowed(text, allowed):
    with pytest.raises(ValueError, match=allowed) as info:
        parse_signature(text)
    assert not isinstance(info.value, UnknownSignatureError)


@pytest.mark.parametrize(
    "text, form",
    [
        ("kv:plain:3", "'kv:plain'"),
        ("kv:quant:4", "kv:quant:{bits}:{group_size}"),
        ("kv:quant:4:64:1", "kv:quant:{bits}:{group_size}"),
    ],
)
def test_wrong_parameter_count(text, form):
    with pytest.raises(ValueError, match=form.replace("{", r"\{").replace("}", r"\}")):
        parse_signature(text)


@pytest.mark.parametrize(
    "text",
    ["kv:foo", "", "kv", "plain", "KV:PLAIN", "kv:quant4:64", "batch", "batch:kv:foo"],
)
def test_unknown_kind_lists_registered(text):
    with pytest.raises(UnknownSignatureError) as info:
        parse_signature(text)
    err = info.value
    assert isinstance(err, LookupError) and isinstance(err, KVStoreError)
    for kind in registered_kinds():
        assert kind in str(err)
    assert err.supported == registered_kinds()


@pytest.mark.parametrize("value", [None, 3, b"kv:plain", ["kv:plain"], object()])
def test_non_str_is_type_error(value):
    with pytest.raises(TypeError, match="must be a str"):
        parse_signature(value)


@given(st.text(max_size=40))
def test_arbitrary_text_parses_or_raises_our_errors(text):
    try:
        sig = parse_signature(text)
    except (UnknownSignatureError, ValueError):
        return
    assert format_signature(sig) == text
    assert sig.kind in registered_kinds()


def test_a_registered_family_is_parsed_against_its_declaration(registries_restored):
    with pytest.raises(UnknownSignatureError):
        parse_signature("kv:toy:3")
    register_family(Family("kv:toy", "a test family", params=(ParamSpec("width", (3, 5)),)))
    assert parse_signature("kv:toy:3").param("width") == 3
    assert "kv:toy" in registered_kinds()
    with pytest.raises(ValueError, match="width must be one of 3, 5"):
        parse_signature("kv:toy:4")
    with pytest.raises(ValueError, match=r"kv:toy:\{width\}"):
        parse_signature("kv:toy")


def test_a_cache_of_a_kind_registered_later_reports_it_then(registries_restored):
    from kvstore.abc.cache import signature_string
    from kvstore.signature import UNKNOWN

    class Toy:
        def signature(self):
            return "kv:toy:3"

    assert signature_string(Toy()) == UNKNOWN  # not registered: unknown, and not kept so
    register_family(Family("kv:toy", "a test family", params=(ParamSpec("width", (3, 5)),)))
    assert signature_string(Toy()) == "kv:toy:3"


def test_a_kind_keeps_its_meaning(registries_restored):
    register_family(Family("kv:toy", "a test family"))
    register_family(Family("kv:toy", "a test family"))  # the same declaration again
    with pytest.raises(ValueError, match="changed meaning takes a new kind"):
        register_family(Family("kv:toy", "another meaning", lossy=True))


def test_the_batch_wrapper_is_built_in():
    sig = parse_signature("batch:kv:rotating-quant:4:64")
    assert sig.kind == "batch" and sig.inner == Signature("kv:rotating-quant", (4, 64))
    assert str(sig) == "batch:kv:rotating-quant:4:64"
    with pytest.raises(ValueError, match="inner signature"):
        parse_signature("batch:")


def test_the_wrapper_hook_parses_an_inner_signature(registries_restored):
    register_family(Family("wrap", "a test wrapper", wraps=True))
    sig = parse_signature("wrap:kv:quant:8:32")
    assert sig.kind == "wrap" and sig.inner == Signature("kv:quant", (8, 32))
    assert str(sig) == "wrap:kv:quant:8:32"
    with pytest.raises(ValueError, match="inner signature"):
        parse_signature("wrap:")


@pytest.mark.parametrize(
    "declaration, problem",
    [
        (dict(kind="quant"), "prefix:name"),
        (dict(kind="kv:x", storage_policy=True), "storage policy is a lossy growing family"),
        (dict(kind="kv:x", window_of="kv:x"), "cannot window itself"),
        (dict(kind="kv:x", params=(ParamSpec("b", ()),)), "allowed values"),
    ],
)
def test_a_malformed_declaration_is_refused(declaration, problem):
    with pytest.raises(ValueError, match=problem):
        Family(description="bad", **declaration)
