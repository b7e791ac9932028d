"""A header read from the template of an earlier one (``codecs.header_template``) against
the same header parsed in full: on the records of a prefix of every family, and on
headers damaged in the integers a template fills in, the two ways end alike (an equal
header, or the same error type and message), and the template is really used where
it should be."""

from __future__ import annotations

import copy
import re
import struct
from typing import Any

import msgpack
import pytest

from kvstore.caches import KVCache
from kvstore.codecs import encode_record, header_template, read_header, snapshot
from kvstore.codecs.header import MAX_INT
from kvstore.codecs.record import forget_parsed_headers
from kvstore.testing.codec import fill_cache

from .helpers import FAMILIES, craft_record, header_of, payload_of, small_record

_PREFIX = struct.Struct("<4sHHIQ")


def outcome(record: bytes) -> Any:
    """What ``read_header`` makes of ``record`` (the header, with its exact types), or
    the type and message of what it raises."""
    try:
        header = read_header(record)
    except Exception as exc:
        return (type(exc), str(exc))
    return ("ok", header, repr(header))


def in_full(record: bytes) -> Any:
    """``outcome`` with nothing remembered: a full parse."""
    forget_parsed_headers()
    return outcome(record)


def after(template: bytes, record: bytes) -> Any:
    """``outcome`` of ``record`` right after ``template`` was read (and learned)."""
    forget_parsed_headers()
    read_header(template)
    return outcome(record)


def packed_header(record: bytes) -> bytes:
    length = _PREFIX.unpack_from(record)[3]
    return record[_PREFIX.size : _PREFIX.size + length]


def filled_from_template(record: bytes) -> bool:
    """Whether a template read so far vouches for ``record``'s header."""
    return header_template.fill("t", 1, packed_header(record)) is not None


def block_records(family: str, blocks: int = 3, rows: int = 8) -> list[bytes]:
    """Records of consecutive blocks of ``rows`` tokens of one cache of ``family`` (a
    window's blocks too: 24 tokens stay inside a window of 32), two layers each."""
    caches = [FAMILIES[family]() for _ in range(2)]
    for cache in caches:
        fill_cache(cache, [blocks * rows], heads=2, head_dim=64)
    return [
        encode_record([snapshot(c, i * rows, (i + 1) * rows) for c in caches])
        for i in range(blocks)
    ]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_blocks_of_a_prefix_read_alike_from_a_template(family: str) -> None:
    records = block_records(family)
    for record in records[1:]:
        assert after(records[0], record) == in_full(record)
        forget_parsed_headers()
        read_header(records[0])
        assert filled_from_template(record)  # the template served: the test is not vacuous


@pytest.mark.parametrize("family", ["plain", "tq-4-3"])
def test_a_template_of_one_range_reads_later_headers_whole_past_each_integer_width(
    family: str,
) -> None:
    """Blocks starting at 0, 200 and 400 (a fixint, a uint8, a uint16) read from the first
    one's template, every layer of each at one range: rebuilt and compared whole
    (``_uniform_integers``), the same integers a walk of the cuts finds."""
    records = block_records(family, rows=200)
    forget_parsed_headers()
    read_header(records[0])
    (template,) = header_template._recent(1)
    assert template.uniform
    for record in records[1:]:
        packed = packed_header(record)
        walked = header_template._integers(template.skeleton, packed)
        assert walked is not None
        assert header_template._uniform_integers(template, packed) == walked
        assert after(records[0], record) == in_full(record)


def test_a_header_whose_layers_differ_in_range_is_walked_not_rebuilt() -> None:
    """A uniform template, and a header whose second layer alone is another range: the
    rebuilt header differs, so its integers are the walk's, and it reads as in full."""
    records = block_records("plain", blocks=2)

    def shorten(header: dict[str, Any]) -> None:
        header["layers"][1]["stop"] -= 1

    record = with_header(records[1], shorten)
    forget_parsed_headers()
    read_header(records[0])
    (template,) = header_template._recent(1)
    packed = packed_header(record)
    assert header_template._uniform_integers(template, packed) is None
    assert header_template._integers(template.skeleton, packed) is not None
    assert after(records[0], record) == in_full(record)


def with_header(record: bytes, change: Any) -> bytes:
    """``record`` with its header changed by ``change(header)`` and checksums made right."""
    header = copy.deepcopy(header_of(record))
    change(header)
    return craft_record(header, payload_of(record))


SMALL = small_record()
#: Values for a start or a stop: in and out of each bound a check has.
VALUES = (0, 1, 2, 3, 4, 5, 1 << 32, (1 << 32) + 1, MAX_INT, MAX_INT + 1, (1 << 64) - 1)


@pytest.mark.parametrize("end", ["start", "stop"])
@pytest.mark.parametrize("value", VALUES)
def test_a_range_changed_in_a_template_read_ends_as_a_full_parse(end: str, value: int) -> None:
    """Every present layer of the small record (plain, 4-bit affine, TurboQuant) with its
    start or its stop set to each value: the codecs' description checks read them."""
    present = [i for i, layer in enumerate(header_of(SMALL)["layers"]) if layer is not None]
    for i in present:

        def change(header: dict[str, Any], i: int = i) -> None:
            header["layers"][i][end] = value

        record = with_header(SMALL, change)
        assert after(SMALL, record) == in_full(record), (i, end, value)


@pytest.mark.parametrize("widened", [0, 1])
def test_each_layer_of_a_template_read_is_checked_for_its_own_range(widened: int) -> None:
    """Two layers alike but for their ranges: a template read checks each range, not one
    of them alone (a stop past the rows fails only the layer widened)."""
    caches = [KVCache(), KVCache()]
    for cache in caches:
        fill_cache(cache, [16], heads=1, head_dim=32)
    template = encode_record([snapshot(c, 0, 8) for c in caches])

    def widen(header: dict[str, Any]) -> None:
        header["layers"][widened]["stop"] += 1

    record = with_header(template, widen)
    expected = in_full(record)
    assert expected[0] != "ok" and f"layers[{widened}]" in expected[1]
    assert after(template, record) == expected


def test_a_cut_inside_a_bin_is_never_taken_for_a_field() -> None:
    """A header that writes its payload checksum as an int16 (not a cut) and whose meta
    holds a bin with the bytes of a cut checksum of the same value: the cuts' count and
    values agree with the fields', but one cut is inside the bin. The template must be
    refused, or a header differing only in that bin would read as the template's."""
    cache = KVCache()
    fill_cache(cache, [16], heads=1, head_dim=32)
    record = encode_record([snapshot(cache, 0, 8)])

    def crafted(note: int) -> bytes:
        header = header_of(record)
        header["checksum"]["value"] = 12345
        header["meta"] = {"note": b"\xa5value\xcd" + struct.pack(">H", note)}
        packed = msgpack.packb(header, use_bin_type=True)
        real = b"\xa5value\xcd" + struct.pack(">H", 12345)
        at = packed.rindex(real)  # the checksum's own, after the meta
        packed = (
            packed[:at] + b"\xa5value\xd1" + struct.pack(">h", 12345) + packed[at + len(real) :]
        )
        return craft_record(None, payload_of(record), raw_header=packed)

    first, second = crafted(12345), crafted(12346)
    assert after(first, second) == in_full(second)
    forget_parsed_headers()
    read_header(first)
    assert not filled_from_template(second)


_UINT = rb"(?:\xcf[\x00-\xff]{8}|\xce[\x00-\xff]{4}|\xcd[\x00-\xff]{2}|\xcc[\x00-\xff]|[\x00-\x7f])"


def reencoded(record: bytes, key: bytes, encoding: bytes) -> bytes:
    """``record`` with the integer after each msgpack key ``key`` written as a uint64
    of the same value (``encoding`` ``b"\\xcf"``), or replaced by the token ``encoding``."""
    packed = packed_header(record)

    def one(match: re.Match[bytes]) -> bytes:
        if encoding == b"\xcf":
            return key + b"\xcf" + struct.pack(">Q", msgpack.unpackb(match.group(1)))
        return key + encoding

    changed = re.sub(re.escape(key) + b"(" + _UINT + b")", one, packed)
    assert changed != packed
    return craft_record(None, payload_of(record), raw_header=changed)


@pytest.mark.parametrize(
    ("key", "encoding"),
    [
        (b"\xa5start", b"\xcf"),  # the same values, written wide: still a template read
        (b"\xa4stop", b"\xcf"),
        (b"\xa5start", b"\xff"),  # a negative fixint: not a cut, parsed in full
        (b"\xa4stop", b"\xd0\x05"),  # int8 5: not a cut either
        (b"\xa5start", b"\xc0"),  # nil
        (b"\xa4stop", b"\xa15"),  # the string "5"
    ],
)
def test_a_range_written_another_way_ends_as_a_full_parse(key: bytes, encoding: bytes) -> None:
    record = reencoded(block_records("plain")[1], key, encoding)
    template = block_records("plain")[0]
    assert after(template, record) == in_full(record)


@pytest.mark.parametrize(
    "meta",
    [
        {"start": 7},  # one cut more than the layers' ranges: no template
        {"note": b"\xa5start\x05"},  # a cut inside a bin: no template
        {"note": "\xa4stop\x01"},
    ],
)
def test_a_header_with_a_cut_key_of_its_own_is_never_a_template(meta: dict[str, Any]) -> None:
    caches = [KVCache(), KVCache()]
    for cache in caches:
        fill_cache(cache, [16], heads=1, head_dim=32)
    first, second = (
        encode_record([snapshot(c, a, a + 8) for c in caches], meta=meta) for a in (0, 8)
    )
    assert after(first, second) == in_full(second)
    forget_parsed_headers()
    read_header(first)
    if b"\xa5start" in packed_header(first) or b"\xa4stop\x01" in packed_header(first):
        # the key's bytes are there; whatever the cut, nothing vouches for the next header
        assert not filled_from_template(second)


def test_forgetting_parsed_headers_forgets_the_templates() -> None:
    first, second = block_records("plain")[:2]
    forget_parsed_headers()
    read_header(first)
    assert filled_from_template(second)
    forget_parsed_headers()
    assert not filled_from_template(second)
