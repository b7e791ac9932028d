"""A lazily decoded layer (kvstore.codecs.payload_tensors): the same views a decode
makes, made only when asked, and where a gather reads them (gather_tables.stored_layout)."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.codecs import decode_record, encode_record, gather_tables
from kvstore.codecs.payload_tensors import PayloadTensors, stored

from .test_record import mixed_layers


@pytest.fixture
def record():
    return bytes(encode_record(mixed_layers()))


def test_lazy_layers_hold_the_views_a_decode_makes_made_only_when_asked(record):
    eager = decode_record(record)
    lazy = decode_record(record, lazy_layers={0, 2})
    for i, (a, b) in enumerate(zip(eager.layers, lazy.layers, strict=True)):
        if a is None:
            assert b is None
            continue
        assert (a.signature, a.start, a.stop, a.meta) == (b.signature, b.start, b.stop, b.meta)
        described = stored(b.tensors)
        assert (described is not None) == (i in {0, 2})
        if described is not None:
            for name in a.tensors:  # asked about without a view made
                assert name in described
                assert described.shape(name) == a.tensors[name].shape
                assert described.address(name) == a.tensors[name].ctypes.data
            assert "nothing" not in described and described._views == {}
        assert list(b.tensors) == list(a.tensors)
        for name, view in a.tensors.items():
            got = b.tensors[name]
            assert got.dtype == view.dtype and got.dtype.metadata == view.dtype.metadata
            assert got.ctypes.data == view.ctypes.data  # a view of the same bytes
            assert np.array_equal(got, view)


def test_a_cut_holds_each_tensors_first_rows(record):
    eager = decode_record(record).layers[0]
    described = stored(decode_record(record, lazy_layers={0}).layers[0].tensors)
    assert described is not None
    cut = described.cut(5)
    for name, view in eager.tensors.items():
        assert cut.shape(name) == view[:, :, :5].shape
        assert np.array_equal(cut[name], view[:, :, :5])
        assert cut.address(name) == view.ctypes.data
    assert described.rows is None and cut.rows == 5  # the uncut one is unchanged


def described_keys(record: bytes, rows: int | None = None) -> tuple[PayloadTensors, str]:
    tensors = stored(decode_record(record, lazy_layers={0}).layers[0].tensors)
    assert tensors is not None
    return (tensors if rows is None else tensors.cut(rows)), "keys"


def test_a_stored_layout_reads_what_the_views_layout_reads(record):
    a, name = described_keys(record)
    b, _ = described_keys(record, 7)
    shape = (*a.shape(name)[:2], 30, *a.shape(name)[3:])
    dtype = a.entries[name].dtype
    got = gather_tables.stored_layout(
        [t.address(name) for t in (a, b)],
        [t.entries[name].shape for t in (a, b)],
        [t.shape(name)[2] for t in (a, b)],
        [dtype, dtype],
        shape,
        dtype,
    )
    assert got == gather_tables.host_layout([a[name], b[name]], shape, dtype)


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ("dtype", "another dtype"),
        ("heads", "other leading dims"),
        ("width", "other trailing dims"),
        ("rows", "more rows than stored"),
        ("capacity", "more rows than the array holds"),
    ],
)
def test_a_stored_layout_that_cannot_be_gathered_is_none(record, change, why):
    tensors, name = described_keys(record)
    stored_shape = tensors.entries[name].shape
    dtype = tensors.entries[name].dtype
    shape = (*stored_shape[:2], 2 * stored_shape[2], *stored_shape[3:])
    counts = [stored_shape[2]] * 2
    dtypes = [dtype, dtype]
    shapes = [stored_shape, stored_shape]
    if change == "dtype":
        dtypes[1] = "float32" if dtype != "float32" else "float16"
    elif change == "heads":
        shapes[1] = (stored_shape[0], stored_shape[1] + 1, *stored_shape[2:])
    elif change == "width":
        shapes[1] = (*stored_shape[:3], stored_shape[3] + 1)
    elif change == "rows":
        counts[1] = stored_shape[2] + 1
    else:
        shape = (*stored_shape[:2], 2 * stored_shape[2] - 1, *stored_shape[3:])
    address = tensors.address(name)
    got = gather_tables.stored_layout([address] * 2, shapes, counts, dtypes, shape, dtype)
    assert got is None, why


@pytest.mark.parametrize("cuts", [(None, None), (None, 7), (0, None), (3, 0)])
def test_an_alike_layout_is_the_stored_layout_of_pieces_laid_out_alike(record, cuts):
    pieces = [described_keys(record, rows)[0] for rows in cuts]
    name = "keys"
    stored_shape, dtype = pieces[0].entries[name].shape, pieces[0].entries[name].dtype
    shape = (*stored_shape[:2], 2 * stored_shape[2], *stored_shape[3:])
    addresses = [t.address(name) for t in pieces]
    counts = [t.shape(name)[2] for t in pieces]
    want = gather_tables.stored_layout(
        addresses, [stored_shape] * 2, counts, [dtype] * 2, shape, dtype
    )
    got = gather_tables.alike_layout(addresses, stored_shape, counts, dtype, shape, dtype)
    assert got is not None and got == want


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ("dtype", "another dtype than the array's"),
        ("rows", "more rows than stored"),
        ("capacity", "more rows than the array holds"),
        ("heads", "other leading dims than the array's"),
    ],
)
def test_an_alike_layout_that_cannot_be_gathered_is_none(record, change, why):
    tensors, name = described_keys(record)
    stored_shape, dtype = tensors.entries[name].shape, tensors.entries[name].dtype
    shape = (*stored_shape[:2], 2 * stored_shape[2], *stored_shape[3:])
    counts = [stored_shape[2]] * 2
    name_asked = dtype
    if change == "dtype":
        name_asked = "float32" if dtype != "float32" else "float16"
    elif change == "rows":
        counts[1] = stored_shape[2] + 1
    elif change == "capacity":
        shape = (*stored_shape[:2], 2 * stored_shape[2] - 1, *stored_shape[3:])
    else:
        shape = (stored_shape[0], stored_shape[1] + 1, *shape[2:])
    address = tensors.address(name)
    got = gather_tables.alike_layout([address] * 2, stored_shape, counts, dtype, shape, name_asked)
    assert got is None, why


def test_layers_of_one_header_template_share_their_entries_and_a_cut_keeps_them(record):
    from kvstore.codecs.payload_tensors import same_entries

    from .test_record import mixed_layers

    # Another record laid out alike (another header: its meta differs).
    alike = bytes(encode_record(mixed_layers(), meta={"tokens": [7]}))
    first = stored(decode_record(record, lazy_layers={0}).layers[0].tensors)
    again = stored(decode_record(alike, lazy_layers={0}).layers[0].tensors)
    assert first is not None and again is not None and bytes(alike) != record
    assert same_entries([first, again, first.cut(3)])
    layers = mixed_layers()
    other = bytes(encode_record([layers[2], None, layers[0], layers[3]]))
    moved = stored(decode_record(other, lazy_layers={0}).layers[0].tensors)
    assert moved is not None and not same_entries([first, moved])


@pytest.mark.parametrize("cut", [None, 5, 1])
def test_a_run_laid_out_alike_names_the_row_tensors_the_per_snapshot_way_does(record, cut):
    from kvstore.abc.codec import Snapshot
    from kvstore.codecs.payload_tensors import same_entries
    from kvstore.codecs.plans import _row_names

    from .test_record import mixed_layers

    records = [record, bytes(encode_record(mixed_layers(), meta={"tokens": [1]}))]
    layers = [decode_record(r, lazy_layers={0, 2}).layers for r in records]
    for i in (0, 2):  # a plain layer and a quantized one (its scales and biases are rows)
        snaps = [layer[i] for layer in layers]
        if cut is not None:  # the match ends inside the last block
            last = snaps[-1]
            described = stored(last.tensors)
            assert described is not None
            snaps[-1] = Snapshot(
                last.signature, last.start, last.start + cut, described.cut(cut), last.meta
            )
        assert same_entries([stored(snap.tensors) for snap in snaps])
        alike = _row_names(snaps)
        for snap in snaps:  # each its own mapping: the per-snapshot way
            tensors = stored(snap.tensors)
            assert tensors is not None
            tensors.entries = dict(tensors.entries)
        assert alike == _row_names(snaps)
        assert alike or cut == 1  # one-token snapshots: none
