"""A one-buffer gather's segment table made for every array at once
(kvstore.codecs.gather_tables.alike_table): word for word the table the per-array path makes
from each array's alike_layout, and None wherever one of those is None."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.codecs import gather_tables, one_buffer

#: Kinds of tensor as a lossy record stores them: (stored shape, dtype).
KINDS = [
    ((1, 2, 16, 8), "uint32"),  # TurboQuant codes
    ((1, 2, 16), "float16"),  # its scales: no trailing dims
    ((2, 3, 16, 4), "bfloat16"),  # a batch of two
    ((1, 2, 16, 5), "uint8"),  # rows of 5 bytes: no 16-byte words
]


def case(rng, kinds, records, counts_of):
    """Arrays of ``kinds`` (indices into KINDS), each from every one of ``records`` at
    an offset of its own, ``counts_of(kind)`` rows of each record read: the AlikeRows,
    the arrays' specs and each array's alike_layout."""
    bases = [int(b) for b in rng.integers(1, 1 << 40, records) * 64]
    offsets, shapes, dtypes, counts, specs, layouts = [], [], [], [], [], []
    for kind in kinds:
        shape, dtype = KINDS[kind]
        cuts = counts_of(shape[2])
        capacity = sum(cuts) + int(rng.integers(0, 3))
        spec = ((*shape[:2], capacity, *shape[3:]), dtype)
        offset = int(rng.integers(0, 1 << 20)) * 16
        offsets.append(offset)
        shapes.append(shape)
        dtypes.append(dtype)
        counts.append(cuts)
        specs.append(spec)
        addresses = [base + offset for base in bases]
        layouts.append(gather_tables.alike_layout(addresses, shape, cuts, dtype, *spec))
    return gather_tables.AlikeRows(bases, offsets, shapes, dtypes, counts), specs, layouts


def cut_counts(records, cuts):
    """The rows read of each of ``records`` pieces ``stored`` rows deep: all of them
    (``whole``), the last one's cut, or the last or first one empty."""

    def counts_of(stored: int) -> list[int]:
        out = [stored] * records
        if cuts == "last-cut":
            out[-1] = stored // 2 + 1
        elif cuts == "empty-piece":
            out[-1] = 0
        elif cuts == "first-empty":
            out[0] = 0
        return out

    return counts_of


@pytest.mark.parametrize("records", [1, 3, 16])
@pytest.mark.parametrize(
    "cuts",
    ["whole", "last-cut", "empty-piece", "first-empty"],
)
def test_the_table_for_all_arrays_is_the_per_array_paths_table(records, cuts):
    rng = np.random.default_rng(records)
    counts_of = cut_counts(records, cuts)
    kinds = [0, 1, 2, 3, 0, 1, 3, 2, 1, 0]
    rows, specs, layouts = case(rng, kinds, records, counts_of)
    assert all(layout is not None for layout in layouts)
    want = gather_tables.segment_table(layouts, one_buffer.buffer_starts(specs))
    got = gather_tables.alike_table(rows, specs)
    assert got is not None and got.dtype == want.dtype
    assert np.array_equal(got, want)


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ("dtype", "another dtype than the array's"),
        ("heads", "other leading dims than the array's"),
        ("width", "other trailing dims than the array's"),
        ("rows", "more rows than stored"),
        ("negative", "fewer than no rows"),
        ("capacity", "more rows than the array holds"),
    ],
)
def test_a_table_some_array_cannot_be_gathered_by_is_none(change, why):
    rng = np.random.default_rng(7)
    rows, specs, _ = case(rng, [0, 1, 2], 4, lambda stored: [stored] * 4)
    shapes, dtypes, counts = list(rows.shapes), list(rows.dtypes), [list(c) for c in rows.counts]
    (shape, name) = specs[2]
    if change == "dtype":
        dtypes[2] = "float16"
    elif change == "heads":
        specs[2] = ((shape[0], shape[1] + 1, *shape[2:]), name)
    elif change == "width":
        specs[2] = ((*shape[:3], shape[3] + 1), name)
    elif change == "rows":
        counts[2][1] = shapes[2][2] + 1
    elif change == "negative":
        counts[2][1] = -1
    else:
        specs[2] = ((*shape[:2], sum(counts[2]) - 1, *shape[3:]), name)
    changed = gather_tables.AlikeRows(rows.bases, rows.offsets, shapes, dtypes, counts)
    assert gather_tables.alike_table(changed, specs) is None, why


def stacked_case(rng, kinds, layers, records, counts_of):
    """StackedRows of ``kinds`` (indices into KINDS), each kind's array in every one of
    ``layers`` at an offset of its own, one capacity per kind; and the same arrays as
    AlikeRows with their specs, kind by kind and layer by layer."""
    bases = [int(b) for b in rng.integers(1, 1 << 40, records) * 64]
    offsets, shapes, dtypes, counts, specs = [], [], [], [], []
    for kind in kinds:
        shape, dtype = KINDS[kind]
        cuts = counts_of(shape[2])
        offsets.append([int(o) * 16 for o in rng.integers(0, 1 << 20, layers)])
        shapes.append(shape)
        dtypes.append(dtype)
        counts.append(cuts)
        specs.append(((*shape[:2], sum(cuts) + int(rng.integers(0, 3)), *shape[3:]), dtype))
    stacked = gather_tables.StackedRows(bases, offsets, shapes, dtypes, counts)
    alike = gather_tables.AlikeRows(
        bases,
        [o for layer_offsets in offsets for o in layer_offsets],
        [s for s in shapes for _ in range(layers)],
        [d for d in dtypes for _ in range(layers)],
        [c for c in counts for _ in range(layers)],
    )
    return stacked, specs, alike, [spec for spec in specs for _ in range(layers)]


@pytest.mark.parametrize("layers", [1, 4])
@pytest.mark.parametrize("records", [1, 3])
@pytest.mark.parametrize("cuts", ["whole", "last-cut", "empty-piece"])
def test_the_table_made_per_kind_is_the_table_made_per_array(layers, records, cuts):
    """stacked_table (a kind's arrays of every layer from what they share) is word for
    word alike_table of the same arrays one by one: 16-byte and unaligned kinds, a cut
    or empty last piece, one layer or several."""
    rng = np.random.default_rng(layers * 10 + records)
    counts_of = cut_counts(records, cuts)
    stacked, specs, alike, every = stacked_case(rng, [0, 1, 3, 2], layers, records, counts_of)
    want = gather_tables.alike_table(alike, every)
    got = gather_tables.stacked_table(stacked, specs)
    assert want is not None and got is not None
    assert np.array_equal(got, want)


@pytest.mark.parametrize("change", ["dtype", "heads", "rows", "capacity", "layers"])
def test_a_table_per_kind_some_array_cannot_be_gathered_by_is_none(change):
    rng = np.random.default_rng(3)
    stacked, specs, _, _ = stacked_case(rng, [0, 1], 3, 4, lambda stored: [stored] * 4)
    offsets, dtypes = [list(o) for o in stacked.offsets], list(stacked.dtypes)
    counts = [list(c) for c in stacked.counts]
    shape, name = specs[1]
    if change == "dtype":
        dtypes[1] = "float32"
    elif change == "heads":
        specs[1] = ((shape[0], shape[1] + 1, *shape[2:]), name)
    elif change == "rows":
        counts[1][2] = stacked.shapes[1][2] + 1
    elif change == "capacity":
        specs[1] = ((*shape[:2], sum(counts[1]) - 1, *shape[3:]), name)
    else:  # a kind with fewer layers than the others
        offsets[1] = offsets[1][:-1]
    changed = gather_tables.StackedRows(stacked.bases, offsets, stacked.shapes, dtypes, counts)
    assert gather_tables.stacked_table(changed, specs) is None, change
