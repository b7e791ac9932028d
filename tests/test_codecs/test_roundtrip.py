"""Acceptance 1-3 at the cache level: bit-exact round trips, restore-then-continue,
and consecutive ranges restoring what one whole snapshot restores."""

import mlx.core as mx
import pytest

from kvstore.caches import RotatingKVCache, RotatingQuantizedKVCache, RotatingTurboQuantKVCache
from kvstore.codecs import restore, snapshot, snapshot_held
from kvstore.codecs.ring import RingView
from kvstore.errors import CapabilityError, CorruptEntryError
from kvstore.testing.codec import (
    assert_snapshots_equal,
    check_continue,
    check_roundtrip,
    check_signature,
    fill_cache,
)

from .helpers import FAMILIES, HEAD_DIMS, HISTORIES, head_dim_fits

CONTINUE = [1, 1, 5, 1, 40, 1, 1]


@pytest.mark.parametrize("history", list(HISTORIES))
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize(
    "family, head_dim",
    [(f, d) for f in FAMILIES for d in HEAD_DIMS if head_dim_fits(f, d)],
)
def test_roundtrip_bit_exact_then_continue(family, dtype, head_dim, history):
    shape = {"dtype": dtype, "head_dim": head_dim}
    cache = FAMILIES[family]()
    fill_cache(cache, HISTORIES[history], **shape)
    check_signature(cache.signature())
    restored = check_roundtrip(cache)
    # Every path restores a cache that continues exactly like the original.
    for i, again in enumerate(restored):
        original = FAMILIES[family]()
        fill_cache(original, HISTORIES[history], **shape)
        check_continue(original, again, CONTINUE, seed=100 + i, **shape)


def test_wrapped_ring_with_keep_is_covered():
    cache = RotatingKVCache(32, keep=4)
    fill_cache(cache, HISTORIES["wrapped"])
    ring = RingView.of(cache)
    assert ring.rotated and ring.held() == [(0, 4), (24, 52)]
    held = snapshot_held(cache)
    assert [(s.start, s.stop) for s in held] == [(0, 4), (24, 52)]
    ring_meta = {"dtype": "float16", "offset": 52, "max_size": 32, "keep": 4, "ring_idx": 16}
    assert held[0].meta == held[1].meta == ring_meta


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("cuts", [[0, 1, 2, 300], [0, 17, 256, 300], [0, 150, 300]])
def test_consecutive_ranges_restore_the_whole(family, cuts):
    # A prefill chunk of 300 leaves even a 32-window ring holding all 300 rows.
    cache = FAMILIES[family]()
    fill_cache(cache, [300])
    whole = restore(snapshot(cache))
    parts = restore([snapshot(cache, a, b) for a, b in zip(cuts, cuts[1:], strict=False)])
    assert_snapshots_equal(snapshot_held(whole), snapshot_held(parts))
    check_continue(whole, parts, CONTINUE)


@pytest.mark.parametrize(
    "cls", [RotatingKVCache, RotatingQuantizedKVCache, RotatingTurboQuantKVCache]
)
@pytest.mark.parametrize("chunks", [[16] * 6, [16] * 5 + [7], [20, 16, 16, 16, 1, 1]])
def test_ring_restores_from_blocks_covering_keep_and_window(cls, chunks):
    # Blocks are captured right after each chunk, while the ring still holds them
    # (as a store does during chunked prefill).
    cache, blocks = cls(32, keep=4), []
    for n in chunks:
        fill_cache(cache, [n], seed=len(blocks))
        blocks.append(snapshot(cache, cache.offset - n, cache.offset))
    n = cache.offset
    needed = [b for b in blocks if b.start < 4 or b.stop > n - 28]
    assert len(needed) < len(blocks)  # the test drops blocks the window no longer needs
    for chosen in (needed, blocks):
        reference, again = restore(snapshot_held(cache)), restore(chosen)
        assert_snapshots_equal(snapshot_held(reference), snapshot_held(again))
        check_continue(reference, again, CONTINUE)
    original = cls(32, keep=4)
    for i, n in enumerate(chunks):
        fill_cache(original, [n], seed=i)
    check_continue(original, restore(needed), CONTINUE)


def test_ring_restore_says_which_positions_are_missing():
    cache = RotatingKVCache(32, keep=4)
    blocks = []
    for i in range(4):
        fill_cache(cache, [16], seed=i)
        blocks.append(snapshot(cache, cache.offset - 16, cache.offset))
    with pytest.raises(CapabilityError, match=r"leave out \[36, 48\)") as info:
        restore([blocks[0], blocks[3]])
    assert info.value.missing == [(36, 48)]
    with pytest.raises(CapabilityError, match="sorted by start"):
        restore([blocks[1], blocks[0]])


def test_ring_snapshot_of_positions_gone():
    cache = RotatingKVCache(32, keep=4)
    fill_cache(cache, HISTORIES["wrapped"])
    with pytest.raises(CapabilityError, match=r"no longer holds positions \[4, 24\)") as info:
        snapshot(cache, 0, 30)
    assert info.value.held == [(0, 4), (24, 52)]
    assert snapshot(cache, 30, 52).tokens == 22


def test_growing_restore_needs_ranges_from_zero():
    cache = FAMILIES["plain"]()
    fill_cache(cache, [40])
    with pytest.raises(CapabilityError, match="expected a range starting at 0"):
        restore(snapshot(cache, 10, 40))
    with pytest.raises(CapabilityError, match=r"starting at 10, received \[20, 40\)"):
        restore([snapshot(cache, 0, 10), snapshot(cache, 20, 40)])


def test_snapshot_range_errors():
    cache = FAMILIES["quant-4-64"]()
    fill_cache(cache, [10])
    with pytest.raises(CapabilityError, match=r"positions \[10, 12\) of \[5, 12\) do not exist"):
        snapshot(cache, 5, 12)
    with pytest.raises(ValueError, match="0 <= start <= stop"):
        snapshot(cache, 6, 5)
    with pytest.raises(CapabilityError, match="empty"):
        snapshot(FAMILIES["plain"]())


def test_restore_rejects_mismatched_snapshots():
    a, b = FAMILIES["plain"](), FAMILIES["plain"]()
    fill_cache(a, [10], dtype=mx.float16)
    fill_cache(b, [20], dtype=mx.bfloat16)
    with pytest.raises(CorruptEntryError, match="disagree on dtype"):
        restore([snapshot(a), snapshot(b, 10, 20)])
    c = FAMILIES["plain"]()
    fill_cache(c, [20], head_dim=128)
    with pytest.raises(CorruptEntryError, match="not of one cache"):
        restore([snapshot(a), snapshot(c, 10, 20)])
    s = snapshot(a)
    with pytest.raises(CorruptEntryError, match="tensors"):
        restore(type(s)(s.signature, 0, 10, {"keys": s.tensors["keys"]}, s.meta))


def test_zero_token_snapshot_restores_an_empty_cache_with_room():
    cache = FAMILIES["rotating-keep4"]()
    fill_cache(cache, [5])
    empty = restore(snapshot(cache, 0, 0))
    assert empty.offset == 0 and empty.keys.shape[2] >= 1
    check_continue(FAMILIES["rotating-keep4"](), empty, [3, 1])
