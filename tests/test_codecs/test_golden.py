"""Golden fixtures: records written by an earlier kvstore still decode, and restore
the caches they were taken from. Written only by tools/write_golden.py."""

from pathlib import Path

import pytest

from kvstore.codecs.registry import find_codec_class
from kvstore.family import families
from kvstore.testing.codec import check_golden

GOLDEN = Path(__file__).parent.parent / "fixtures" / "golden"
FIXTURES = sorted(GOLDEN.glob("*/format-*"))


def test_every_builtin_family_has_a_format_1_fixture():
    # kv:rotating-quant -> kv-rotating-quant/format-1/ (tools/write_golden.py writes it)
    # (a wrapper family, batch:, has no codec: batches are stored row by row)
    builtin = [
        f
        for f in families()
        if not f.wraps and find_codec_class(f.kind).__module__.startswith("kvstore.")
    ]
    expected = {f.kind.replace(":", "-") for f in builtin} | {"mixed"}
    assert {p.parent.name for p in FIXTURES if p.name == "format-1"} >= expected


@pytest.mark.parametrize("directory", FIXTURES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_golden_fixture_decodes_and_restores(directory):
    check_golden(directory)
