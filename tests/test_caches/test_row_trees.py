"""Row trees walked directly (kvstore.caches.base): the same leaves and maps as mlx.utils'
general trees, for every shape of tree a cache holds."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten, tree_map

from kvstore.caches.base import map_rows, row_leaves


def arrays(n: int) -> list[mx.array]:
    return [mx.full((1, 2, 3, 4), float(i)) for i in range(n)]


TREES = {
    "bare": lambda a: a[0],
    "affine": lambda a: (a[0], a[1], a[2]),
    "keys and values": lambda a: (a[0], a[1]),
    "nested": lambda a: ((a[0], a[1], a[2]), (a[3], a[4], a[5])),
    "list": lambda a: [a[0], (a[1], a[2])],
    "dict": lambda a: {"k": a[0], "v": (a[1], a[2])},
}


@pytest.mark.parametrize("shape", TREES)
def test_row_trees_walk_as_mlx_utils_does(shape):
    make = TREES[shape]
    tree, other = make(arrays(6)), make(arrays(6)[::-1])
    assert [id(a) for a in row_leaves(tree)] == [id(a) for _, a in tree_flatten(tree)]
    ours = map_rows(lambda a, b: a * 10 + b, tree, other)
    theirs = tree_map(lambda a, b: a * 10 + b, tree, other)
    assert type(ours) is type(theirs)
    flat_ours, flat_theirs = row_leaves(ours), [a for _, a in tree_flatten(theirs)]
    assert len(flat_ours) == len(flat_theirs)
    assert all(mx.array_equal(a, b).item() for a, b in zip(flat_ours, flat_theirs, strict=True))
