"""Row pieces on the device joined into arrays of their own by one kernel per 64
(kvstore.codecs.device_joins), on the stand-in transport's host copy of the kernel: every
byte where it belongs, zeros past the pieces, and no kernel where a piece does not fit.
(The kernel itself is tried on the device by cuda_pages' once-per-process trial.)"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kvstore.codecs import cuda, cuda_pages, device_joins, plans
from tests.test_codecs.test_cuda_staging import host_transport


@pytest.fixture
def staged(monkeypatch):
    return host_transport(monkeypatch)


def stack_of(rng, layers, rows, *, heads=2, dim=8, dtype=mx.bfloat16):
    """A decoded stack ``[layers, heads, rows, dim]`` and its members, one per layer."""
    whole = mx.array(rng.standard_normal((layers, heads, rows, dim)).astype(np.float32)).astype(
        dtype
    )
    members = [whole[i : i + 1] for i in range(layers)]
    return whole, members


def placed(whole, members):
    return [[(m, whole, i * m.nbytes)] for i, m in enumerate(members)]


def want(pieces, capacity):
    rows = mx.concatenate(pieces, axis=2)
    pad = mx.zeros((*rows.shape[:2], capacity - rows.shape[2], *rows.shape[3:]), rows.dtype)
    return mx.concatenate([rows, pad], axis=2)


def test_each_layer_gets_its_rows_then_zeros_from_one_kernel(staged):
    rng = np.random.default_rng(0)
    keys, key_members = stack_of(rng, 5, 7)
    values, value_members = stack_of(rng, 5, 7, dtype=mx.float16)
    columns = placed(keys, key_members) + placed(values, value_members)
    specs = [((1, 2, 9, 8), "bfloat16")] * 5 + [((1, 2, 9, 8), "float16")] * 5
    got = device_joins.joined(specs, columns)
    assert got is not None and staged.assembled_many == [10]
    for array, column, (shape, name) in zip(got, columns, specs, strict=True):
        assert tuple(array.shape) == shape and array.dtype == getattr(mx, name)
        assert mx.array_equal(array, want([p for p, _, _ in column], 9)).item()


def test_pieces_from_several_buffers_and_rows_of_odd_bytes_join_exactly(staged):
    rng = np.random.default_rng(1)
    a, a_members = stack_of(rng, 2, 3, heads=3, dim=3)  # rows of 6 bytes: not 16-byte words
    b, b_members = stack_of(rng, 1, 4, heads=3, dim=3)
    columns = [
        [(a_members[1], a, a_members[0].nbytes), (b_members[0], b, 0)],
        [(a_members[0], a, 0)],
    ]
    specs = [((1, 3, 7, 3), "bfloat16"), ((1, 3, 5, 3), "bfloat16")]
    got = device_joins.joined(specs, columns)
    assert got is not None
    assert mx.array_equal(got[0], want([a_members[1], b_members[0]], 7)).item()
    assert mx.array_equal(got[1], want([a_members[0]], 5)).item()


def test_more_arrays_or_buffers_than_a_kernel_takes_make_more_kernels(staged, monkeypatch):
    monkeypatch.setattr(cuda, "GATHER_OUTPUTS", 4)
    monkeypatch.setattr(cuda, "ASSEMBLE_INPUTS", 3)
    rng = np.random.default_rng(2)
    # 9 arrays of 3 stacks, then 4 of a stack each: 4 arrays to a kernel, and the third
    # kernel stops at its third buffer (the last stack's 9th array, two one-layer ones).
    stacks = [stack_of(rng, 3, 2) for _ in range(3)]
    one_layer = [stack_of(rng, 1, 2) for _ in range(4)]
    columns = [c for whole, members in stacks + one_layer for c in placed(whole, members)]
    specs = [((1, 2, 4, 8), "bfloat16")] * len(columns)
    got = device_joins.joined(specs, columns)
    assert got is not None and staged.assembled_many == [4, 4, 3, 2]
    for array, column in zip(got, columns, strict=True):
        assert mx.array_equal(array, want([column[0][0]], 4)).item()


@pytest.mark.parametrize(
    "spec",
    [
        ((1, 2, 9, 8), "float16"),  # another dtype: it would need a cast
        ((1, 3, 9, 8), "bfloat16"),  # other heads
        ((1, 2, 9, 4), "bfloat16"),  # another head size
        ((1, 2, 6, 8), "bfloat16"),  # more rows than room
    ],
)
def test_a_piece_that_does_not_fit_its_array_makes_no_kernel(staged, spec):
    whole, members = stack_of(np.random.default_rng(3), 2, 7)
    assert device_joins.joined([spec], [[(members[0], whole, 0)]]) is None
    assert staged.assembled_many == []


def test_a_piece_said_to_lie_past_its_buffers_end_makes_no_kernel(staged):
    whole, members = stack_of(np.random.default_rng(4), 2, 7)
    spec = ((1, 2, 9, 8), "bfloat16")
    past = whole.nbytes - members[1].nbytes + 16  # the last member, 16 bytes too far on
    assert device_joins.joined([spec], [[(members[1], whole, past)]]) is None
    assert device_joins.joined([spec], [[(members[1], whole, past - 16)]]) is not None
    assert staged.assembled_many == [1]


def test_an_assemble_of_many_that_returns_wrong_bytes_turns_only_the_joins_off(staged, monkeypatch):
    real = staged.assemble_many
    monkeypatch.setattr(
        staged, "assemble_many", lambda params, b, n: [a + 1 for a in real(params, b, n)]
    )
    monkeypatch.setattr(cuda_pages, "GATHER_MIN_BYTES", 0)
    monkeypatch.setattr(cuda_pages, "_WORKS", None)
    monkeypatch.setattr(cuda_pages, "_WORKS_FUTURE", None)
    monkeypatch.setattr(cuda_pages, "_JOINS_WORK", None)
    assert cuda_pages._works() is True  # the gathers passed: the page route stays on
    assert cuda_pages.proven() and not cuda_pages.joins_proven()
    staged.assembled_many.clear()  # the try's own
    # ...and a restore's decoded rows join by a concatenation each, as before the kernel.
    whole, members = stack_of(np.random.default_rng(5), 2, 3)
    stack = plans.Stack(whole, tuple(members))
    join = plans.RowsJoin([members[1]], 4)
    made = plans._joined_on_device([(0, (join, 0))], [stack])
    assert staged.assembled_many == []
    assert mx.array_equal(made[0], want([members[1]], 4)).item()
    cuda_pages.settle()
