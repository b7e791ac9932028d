"""Per-layer layouts (kvstore.layout, issue 17): selectors, precedence, forms, files."""

import json

import pytest

from kvstore.layout import (
    LayerLayout,
    kind_of_layer,
    kind_of_signature,
    parse_layout,
    read_layout_file,
    write_layout_file,
)

TEXT = "default=kv:quant:4:64;sliding=kv:quant:8:64;0-1=kv:plain;5=kv:turboquant:3:3"


def test_index_beats_kind_beats_default_and_default_never_reaches_recurrent_layers():
    layout = parse_layout(TEXT)
    assert layout.value_for(0, "sliding") == "kv:plain"
    assert layout.value_for(3, "sliding") == "kv:quant:8:64"
    assert layout.value_for(3, "global") == "kv:quant:4:64"
    assert layout.value_for(3, "recurrent") is None
    assert parse_layout("recurrent=rec:x").value_for(9, "recurrent") == "rec:x"


def test_text_dict_and_layout_forms_are_one_layout_with_one_canonical_text():
    layout = parse_layout(TEXT)
    as_dict = {
        "default": "kv:quant:4:64",
        "sliding": "kv:quant:8:64",
        "layers": {"0": "kv:plain", "1": "kv:plain", "5": "kv:turboquant:3:3"},
    }
    assert parse_layout(as_dict) == layout == parse_layout(layout)
    assert parse_layout(layout.to_dict()) == layout
    assert layout.text() == TEXT
    shuffled = (
        "5=kv:turboquant:3:3; 1=kv:plain ;SLIDING=kv:quant:8:64;0=kv:plain;default=kv:quant:4:64"
    )
    assert parse_layout(shuffled).text() == TEXT
    assert layout.values() == ["kv:quant:4:64", "kv:quant:8:64", "kv:plain", "kv:turboquant:3:3"]
    assert layout.max_index() == 5 and layout.uniform() is None
    assert parse_layout("default=kv:plain").uniform() == "kv:plain"


@pytest.mark.parametrize(
    "bad",
    [
        "default=kv:plain;default=kv:quant:4:64",
        "global=a;global=b",
        "0-2=a;2=b",
        "3-1=a",
        "middle=kv:plain",
        "kv:plain",  # an entry without '='
        "0=",
    ],
)
def test_malformed_layouts_are_refused(bad):
    with pytest.raises(ValueError, match=r"^\[layout\]"):
        parse_layout(bad)


def test_values_go_through_the_consumers_check():
    assert parse_layout("0=A;default=b", str.lower).text() == "default=b;0=a"
    with pytest.raises(ValueError, match="nope"):
        parse_layout("0=x", lambda v: (_ for _ in ()).throw(ValueError("nope")))


def test_kinds_of_layers_from_geometry_and_from_families():
    assert kind_of_layer({"sliding_window": None}) == "global"
    assert kind_of_layer({"sliding_window": 32}) == "sliding"
    assert kind_of_layer({"recurrent": "rec:gated-delta"}) == "recurrent"
    assert kind_of_signature("kv:quant:4:64") == "global"
    assert kind_of_signature("kv:rotating-plain") == "sliding"


def test_a_layout_file_round_trips_with_what_travels_beside_it(tmp_path):
    layout = parse_layout(TEXT)
    path = write_layout_file(tmp_path / "p.json", layout, budget="3.5 bits", keep=0)
    again, data = read_layout_file(path)
    assert again == layout and data["budget"] == "3.5 bits"
    (tmp_path / "bare.json").write_text(json.dumps(layout.to_dict()))
    assert read_layout_file(tmp_path / "bare.json")[0] == layout
    (tmp_path / "other.json").write_text(json.dumps({"format": "something/2"}))
    with pytest.raises(ValueError, match="kvstore-layout/1"):
        read_layout_file(tmp_path / "other.json")
    with pytest.raises(ValueError, match="not a readable JSON"):
        read_layout_file(tmp_path / "missing.json")


def test_layouts_are_values():
    a = LayerLayout("x", (("sliding", "y"), ("global", "z")), ((3, "w"), (1, "v")))
    b = LayerLayout("x", (("global", "z"), ("sliding", "y")), ((1, "v"), (3, "w")))
    assert a == b and hash(a) == hash(b) and str(a) == "default=x;global=z;sliding=y;1=v;3=w"
    with pytest.raises(ValueError, match="kinds of layer"):
        LayerLayout(kinds=(("mid", "x"),))
    with pytest.raises(ValueError, match="distinct integers"):
        LayerLayout(layers=((-1, "x"),))
