"""Golden fixtures: records written by an earlier kvstore still decode, and restore
the caches they were taken from. Written only by tools/write_golden.py."""

from pathlib import Path

import pytest

from kvstore.testing.codec import check_golden

GOLDEN = Path(__file__).parent.parent / "fixtures" / "golden"
EXPECTED = {
    "kv-plain",
    "kv-quant",
    "kv-rotating-plain",
    "kv-rotating-quant",
    "kv-turboquant",
    "kv-rotating-turboquant",
    "mixed",
}
FIXTURES = sorted(GOLDEN.glob("*/format-*"))


def test_every_family_has_a_format_1_fixture():
    assert {p.parent.name for p in FIXTURES if p.name == "format-1"} >= EXPECTED


@pytest.mark.parametrize("directory", FIXTURES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_golden_fixture_decodes_and_restores(directory):
    check_golden(directory)
