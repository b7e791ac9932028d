"""The usual header's one pass (``header_parse.usual_header``) against the rule-by-rule
parse (``header.checked_header``): on every header of a corpus of damaged ones, the
fast way accepts only what the checked way accepts, with an equal result, and
``parse_header`` ends exactly as the checked way does (the same error type and
message)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from kvstore.caches import KVCache, RotatingKVCache
from kvstore.codecs import encode_record, get_codec, read_header, snapshot, snapshot_held
from kvstore.codecs.header import (
    BOUNDS,
    MAX_INT,
    MAX_STR_CHARS,
    LayerEntry,
    TensorEntry,
    check_codec_versions,
    checked_header,
    header_fields,
    is_int,
    is_map,
)
from kvstore.codecs.header_parse import parse_header, usual_header
from kvstore.codecs.snapshot_meta import check_layers, checked_by
from kvstore.errors import CorruptEntryError
from kvstore.testing.codec import fill_cache

from .helpers import FAMILIES, craft_record, header_of, payload_of, small_record

RECORD_EXTRA = {"payload_nbytes": is_int, "checksum": is_map}
RECORD = small_record()
HEADER = header_of(RECORD)


def ring_header() -> dict[str, Any]:
    ring = RotatingKVCache(32, keep=4)
    fill_cache(ring, [40] + [1] * 3, heads=1, head_dim=32)
    plain = KVCache()
    fill_cache(plain, [44], heads=1, head_dim=32)
    layers = [*snapshot_held(ring)[:1], snapshot(plain, 0, 4), snapshot(plain, 0, 4)]
    return header_of(encode_record(layers))


RING_HEADER = ring_header()


def outcome(parse, *args: Any, **kwargs: Any) -> Any:
    """What ``parse`` returns, or the type and message of what it raises (any exception:
    the two ways must end alike even where both fail in a way they should not)."""
    try:
        return ("ok", parse(*args, **kwargs))
    except Exception as exc:
        return (type(exc), str(exc))


def checked(op: str, obj: Any, located: bool, extra: Any) -> Any:
    """``parse_header`` without the fast way."""
    f, layers = checked_header(op, obj, header_fields(extra), located)
    check_codec_versions(op, layers)
    check_layers(op, layers)
    return f, layers


def assert_same_as_checked(obj: Any, located: bool = True) -> None:
    extra = RECORD_EXTRA if located else None
    fast = usual_header(obj, header_fields(extra), located)
    if fast is not None:  # accepted: so by the checked way too, with an equal result
        slow = outcome(checked_header, "t", obj, header_fields(extra), located)
        assert slow[0] == "ok", slow
        assert fast[0] is slow[1][0] is obj
        assert fast[1] == slow[1][1] and repr(fast[1]) == repr(slow[1][1])
    expected = outcome(checked, "t", obj, located, extra)
    assert outcome(parse_header, "t", obj, located=located, extra=extra) == expected


# -- the corpus ------------------------------------------------------------------------


def paths(obj: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    found = [prefix]
    if isinstance(obj, dict):
        for key, value in obj.items():
            found += paths(value, (*prefix, key))
    elif isinstance(obj, list):
        for i, value in enumerate(obj):
            found += paths(value, (*prefix, i))
    return found


def replaced(obj: Any, path: tuple[Any, ...], value: Any) -> Any:
    out = copy.deepcopy(obj)
    *head, last = path
    target = out
    for key in head:
        target = target[key]
    target[last] = value
    return out


def removed(obj: Any, path: tuple[Any, ...]) -> Any:
    out = copy.deepcopy(obj)
    *head, last = path
    target = out
    for key in head:
        target = target[key]
    del target[last]
    return out


# Each value of a type or size some field must not have, and some that fit.
WRONG = [
    None,
    True,
    False,
    0,
    1,
    1.0,
    -0.0,
    -1,
    MAX_INT,
    MAX_INT + 1,
    "",
    "x",
    "kv:plain",
    "float16",
    "x" * MAX_STR_CHARS,
    "x" * (MAX_STR_CHARS + 1),
    b"x",
    [],
    [1],
    [True, 1, 3, 32],
    [1, 1, 3.0, 32],
    [1] * (BOUNDS.rank + 1),
    {},
    {"a": 1},
    {"must_understand": False},
]

HEADER_PATHS = paths(HEADER)[1:]
RING_PATHS = paths(RING_HEADER)[1:]


@pytest.mark.parametrize("path", HEADER_PATHS, ids=lambda p: ".".join(map(str, p)))
def test_any_field_replaced(path):
    for value in WRONG:
        assert_same_as_checked(replaced(HEADER, path, value))


@pytest.mark.parametrize("path", RING_PATHS, ids=lambda p: ".".join(map(str, p)))
def test_any_field_of_a_window_and_repeated_layers_replaced(path):
    for value in WRONG:
        assert_same_as_checked(replaced(RING_HEADER, path, value))


@pytest.mark.parametrize(
    "path",
    [p for p in HEADER_PATHS if isinstance(p[-1], str)],
    ids=lambda p: ".".join(map(str, p)),
)
def test_any_field_missing(path):
    assert_same_as_checked(removed(HEADER, path))


def maps_in(obj: Any) -> list[tuple[Any, ...]]:
    def at(path: tuple[Any, ...]) -> Any:
        target = obj
        for key in path:
            target = target[key]
        return target

    return [p for p in paths(obj) if isinstance(at(p), dict)]


@pytest.mark.parametrize("path", maps_in(HEADER), ids=lambda p: ".".join(map(str, p)) or "header")
@pytest.mark.parametrize("value", [1, {"must_understand": False}, {"must_understand": True}])
def test_unknown_fields(path, value):
    assert_same_as_checked(replaced(HEADER, (*path, "zz_new"), value))


def with_layer(change) -> dict[str, Any]:
    out = copy.deepcopy(HEADER)
    change(out["layers"][0])
    return out


def deep(depth: int, leaf: Any = 1) -> Any:
    value: Any = leaf
    for _ in range(depth):
        value = [value]
    return value


CASES = {
    "start after stop": with_layer(lambda e: e.update(start=4)),
    "stop past the largest position": with_layer(
        lambda e: e.update(start=1 << 32, stop=(1 << 32) + 3)
    ),
    "wrong nbytes": with_layer(lambda e: e["tensors"][0].update(nbytes=191)),
    "bad dtype": with_layer(lambda e: e["tensors"][0].update(dtype="complex64")),
    "rank 0": with_layer(lambda e: e["tensors"][0].update(shape=[])),
    "negative dim": with_layer(lambda e: e["tensors"][0].update(shape=[1, 1, -3, 32])),
    "a name twice": with_layer(lambda e: e["tensors"][1].update(name="keys")),
    "overlapping tensors": with_layer(lambda e: e["tensors"][1].update(offset=0)),
    "misaligned": with_layer(lambda e: e["tensors"][1].update(offset=193)),
    "too many tensors": with_layer(
        lambda e: e.update(tensors=e["tensors"] * (BOUNDS.tensors_per_layer // 2 + 1))
    ),
    "codec version not read": with_layer(lambda e: e.update(codec_version=9)),
    "kind not installed": with_layer(lambda e: e.update(signature="kv:elsewhere")),
    "malformed signature": with_layer(lambda e: e.update(signature="kv:quant:x")),
    "another kind's tensors": with_layer(lambda e: e.update(signature="kv:quant:4:32")),
    "meta offset a float": with_layer(lambda e: e["meta"].update(offset=3.0)),
    "meta offset a bool": with_layer(lambda e: e["meta"].update(offset=True)),
    "meta with a non-str key": with_layer(lambda e: e["meta"].update({1: 2})),
    "meta at the depth bound": with_layer(lambda e: e["meta"].update(x=deep(BOUNDS.depth - 5))),
    "meta past the depth bound": with_layer(lambda e: e["meta"].update(x=deep(BOUNDS.depth - 4))),
    "meta with too many entries": with_layer(
        lambda e: e["meta"].update({f"k{i}": i for i in range(BOUNDS.map_len)})
    ),
    "meta with a long string": with_layer(lambda e: e["meta"].update(x="x" * (BOUNDS.str_len + 1))),
    "meta with a long list": with_layer(lambda e: e["meta"].update(x=[0] * (BOUNDS.array_len + 1))),
    "meta with big bytes": with_layer(lambda e: e["meta"].update(x=b"x" * (BOUNDS.bin_len + 1))),
    "meta with a set": with_layer(lambda e: e["meta"].update(x={1})),
    "meta with a tuple": with_layer(lambda e: e["meta"].update(x=(1,))),
    # The layer's meta sits at depth 4 (header 1, layers 2, layer 3): x at 5.
    "an empty list at the depth bound": with_layer(
        lambda e: e["meta"].update(x=deep(BOUNDS.depth - 5, []))
    ),
    "an empty list past the depth bound": with_layer(
        lambda e: e["meta"].update(x=deep(BOUNDS.depth - 4, []))
    ),
    "an empty map past the depth bound": with_layer(
        lambda e: e["meta"].update(x=deep(BOUNDS.depth - 4, {}))
    ),
    "header meta past the depth bound": {**HEADER, "meta": {"x": deep(BOUNDS.depth - 2)}},
    "header meta at the depth bound": {**HEADER, "meta": {"x": deep(BOUNDS.depth - 3)}},
    "header meta with a float key": {**HEADER, "meta": {1.5: 1}},
    "too many layers": {**HEADER, "layers": [None] * (BOUNDS.layers + 1)},
    "no layers": {**HEADER, "layers": []},
    "only absent layers": {**HEADER, "layers": [None, None]},
    "format 2": {**HEADER, "format": 2},
    "format 1.0": {**HEADER, "format": 1.0},
    "checksum with an unknown field": {**HEADER, "checksum": {**HEADER["checksum"], "x": 1}},
    "not a map": [HEADER],
    "a str subclass": with_layer(lambda e: e.update(codec=type("S", (str,), {})("PlainKVCodec"))),
    "a dict subclass": with_layer(lambda e: e.update(meta=type("D", (dict,), {})(e["meta"]))),
    "an int subclass": with_layer(lambda e: e.update(start=type("I", (int,), {})(0))),
}


@pytest.mark.parametrize("name", CASES)
def test_damaged_headers(name):
    assert_same_as_checked(CASES[name])


def ring_with(change) -> dict[str, Any]:
    out = copy.deepcopy(RING_HEADER)  # flat metas only: the checks of all at once
    change(out["layers"][1])
    return out


FLAT_CASES = {
    "a long string": ring_with(lambda e: e["meta"].update(x="x" * (BOUNDS.str_len + 1))),
    "a string at the bound": ring_with(lambda e: e["meta"].update(x="x" * BOUNDS.str_len)),
    "a long key": ring_with(lambda e: e["meta"].update({"k" * (BOUNDS.str_len + 1): 1})),
    "a non-str key": ring_with(lambda e: e["meta"].update({b"k": 1})),
    "too many entries": ring_with(
        lambda e: e["meta"].update({f"k{i}": i for i in range(BOUNDS.map_len)})
    ),
    "bytes": ring_with(lambda e: e["meta"].update(x=b"x")),
    "a float": ring_with(lambda e: e["meta"].update(x=1.5)),
    "a list": ring_with(lambda e: e["meta"].update(x=[1])),
    "a set": ring_with(lambda e: e["meta"].update(x={1})),
}


@pytest.mark.parametrize("name", FLAT_CASES)
def test_damaged_flat_metas(name):
    assert_same_as_checked(FLAT_CASES[name])


def repeated(change_second) -> dict[str, Any]:
    """RING_HEADER, whose plain layers 1 and 2 describe the same snapshot, with layer 2
    changed: a remembered verdict must not carry over to it."""
    out = copy.deepcopy(RING_HEADER)
    change_second(out["layers"][2])
    return out


@pytest.mark.parametrize(
    "change",
    [
        lambda e: e["meta"].update(offset=float(e["meta"]["offset"])),
        lambda e: e["meta"].update(offset=True),
        lambda e: e["meta"].update(offset=-0.0),
        lambda e: e["meta"].update(offset=e["meta"]["offset"] - 1),
        lambda e: e["meta"].update(dtype="float32"),
        lambda e: e["meta"].update(extra=1),
        lambda e: e.update(meta=dict(reversed(e["meta"].items()))),
        lambda e: e.update(stop=e["stop"] + 1),
        lambda e: e["tensors"][0].update(shape=[1, 1, 4, 32], nbytes=256),
        lambda e: e["tensors"].reverse(),
    ],
)
def test_a_layer_like_the_one_before_but_for_one_thing(change):
    obj = repeated(change)
    assert_same_as_checked(obj)
    if isinstance(obj["layers"][2]["meta"].get("offset"), float):
        with pytest.raises(CorruptEntryError, match=r"layers\[2\] .*offset"):
            parse_header("t", obj, located=True, extra=RECORD_EXTRA)


def test_a_window_with_keep_a_bool_is_refused_after_one_with_keep_an_int():
    obj = copy.deepcopy(RING_HEADER)
    window = obj["layers"][0]
    window["meta"]["keep"] = 1
    obj["layers"] = [window, {**copy.deepcopy(window), "meta": {**window["meta"], "keep": True}}]
    parse_header("t", {**obj, "layers": [window]}, located=True, extra=RECORD_EXTRA)  # intact
    with pytest.raises(CorruptEntryError, match=r"layers\[1\] .*keep must be ints"):
        parse_header("t", obj, located=True, extra=RECORD_EXTRA)
    assert_same_as_checked(obj)


def test_headers_without_offsets():
    # .safetensors files: tensors carry no offset/nbytes.
    obj = copy.deepcopy(HEADER)
    del obj["payload_nbytes"], obj["checksum"]
    for entry in obj["layers"]:
        for t in entry["tensors"] if entry else ():
            del t["offset"], t["nbytes"]
    assert_same_as_checked(obj, located=False)
    assert usual_header(obj, header_fields(None), located=False) is not None
    for path in paths(obj)[1:]:
        for value in WRONG:
            assert_same_as_checked(replaced(obj, path, value), located=False)
    assert_same_as_checked(replaced(obj, ("layers", 0, "tensors", 0, "offset"), 0), located=False)


# -- the fast way is the usual way -------------------------------------------------------


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_s_header_takes_the_one_pass(family):
    cache = FAMILIES[family]()
    fill_cache(cache, [40], heads=2, head_dim=64)
    obj = header_of(encode_record(snapshot_held(cache) * 3))
    fast = usual_header(obj, header_fields(RECORD_EXTRA), True)
    assert fast is not None
    assert_same_as_checked(obj)


def test_the_small_record_s_header_takes_the_one_pass():
    assert usual_header(HEADER, header_fields(RECORD_EXTRA), True) is not None
    assert usual_header(RING_HEADER, header_fields(RECORD_EXTRA), True) is not None


def test_entries_are_what_their_constructors_make():
    header = read_header(RECORD)
    for entry in header.layers:
        if entry is None:
            continue
        made = LayerEntry(
            entry.signature,
            entry.codec,
            entry.codec_version,
            entry.start,
            entry.stop,
            entry.meta,
            tuple(TensorEntry(t.name, t.dtype, t.shape, t.offset, t.nbytes) for t in entry.tensors),
        )
        # Its fields alike; the parsed one also notes the codec that checked it (not a field).
        noted = {k: v for k, v in vars(entry).items() if k != "_checked_by"}
        assert made == entry and vars(made) == noted
        assert checked_by(entry) is type(get_codec(entry.signature))
        assert [hash(t) for t in made.tensors] == [hash(t) for t in entry.tensors]
        assert type(made) is type(entry)


# -- extents ---------------------------------------------------------------------------


def extents_record(change) -> bytes:
    out = copy.deepcopy(HEADER)
    change(out["layers"])
    return craft_record(out, payload_of(RECORD))


def test_tensors_out_of_payload_order_are_read():
    def swap(layers):
        a, b = layers[0]["tensors"]
        a["offset"], b["offset"] = b["offset"], a["offset"]

    header = read_header(extents_record(swap))
    assert [t.offset for t in header.layers[0].tensors] == [192, 0]


def test_empty_tensors_between_others_are_read():
    def empty(layers):
        layers[0]["tensors"].insert(
            1, {"name": "x", "dtype": "uint8", "shape": [0], "offset": 1088, "nbytes": 0}
        )

    with pytest.raises(CorruptEntryError, match="tensors"):  # the codec knows no 'x'
        read_header(extents_record(empty))


@pytest.mark.parametrize(
    "change, message",
    [
        (
            lambda ls: ls[2]["tensors"][1].update(offset=385),
            r"layers\[2\] tensor 'keys.scales' at \[385, 391\) is misaligned",
        ),
        (
            lambda ls: ls[3]["tensors"][-1].update(offset=1 << 20),
            r"layers\[3\] tensor .* outside the 1152-byte payload",
        ),
        (lambda ls: ls[2]["tensors"][0].update(offset=192), "Two tensors overlap"),
        (lambda ls: ls[0]["tensors"][1].update(offset=0), "Two tensors overlap"),
    ],
)
def test_extents_errors(change, message):
    with pytest.raises(CorruptEntryError, match=message):
        read_header(extents_record(change))


@pytest.mark.parametrize("depth", [1, 2, BOUNDS.depth - 1, BOUNDS.depth, BOUNDS.depth + 1])
@pytest.mark.parametrize(
    "value",
    [[], {}, [1], {"a": 1}, 1, "x", b"x", None, 1.5, {1: 2}, (1,), "x" * (BOUNDS.str_len + 1)],
)
def test_is_bounded_is_check_bounds_at_any_depth(depth, value):
    from kvstore.codecs.header import check_bounds, is_bounded

    nested = deep(depth - 1, value)  # value sits at `depth`
    assert is_bounded(value, depth) == (outcome(check_bounds, "t", nested)[0] == "ok")


@pytest.mark.parametrize(
    ("second", "bounded"),
    [
        ({"tq": {"k": {"c": [0.5, -0.5], "s": "+-"}}}, True),  # equal to the first
        ({"tq": {"k": {"c": [0.5, -0.5], "s": "+" * (BOUNDS.str_len + 1)}}}, False),  # too long
        ({"tq": {"k": {"c": [0.5, deep(BOUNDS.depth)], "s": "+-"}}}, False),  # too deep
        ({"tq": {"k": {"c": [0.5, b"x" * (BOUNDS.bin_len + 1)], "s": "+-"}}}, False),
        ({"tq": {"k": {"c": [0.5, -0.5], "s": b"+-"}}}, True),  # unequal, walked: bounded
    ],
)
def test_a_nested_meta_passes_only_as_the_one_it_equals(second, bounded):
    # Nested metas equal to one already walked are not walked again: the
    # differential check shows the shortcut refuses exactly what the walk refuses.
    obj = copy.deepcopy(HEADER)
    layer = obj["layers"][0]
    first = {**layer, "meta": {**layer["meta"], "tq": {"k": {"c": [0.5, -0.5], "s": "+-"}}}}
    obj["layers"] = [first, {**copy.deepcopy(first), "meta": {**layer["meta"], **second}}, first]
    assert_same_as_checked(obj)
    taken = usual_header(obj, header_fields(RECORD_EXTRA), True) is not None
    assert taken == bounded
