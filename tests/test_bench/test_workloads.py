"""Synthetic workloads: the shapes of BENCHMARKS.md, seeded data, identical caches for us and
mlx-lm, and the peers' cases doing what they say."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kvstore.bench.workloads import (
    WORKLOADS,
    KVShape,
    SyntheticKV,
    attended_arrays,
    cache_arrays,
    cache_nbytes,
    memcpy_case,
    mlx_lm_load_case,
    mlx_lm_save_case,
    synthetic_kv,
    windowed_signature,
)
from kvstore.family import Family, register_family
from tests.markers import needs_tested_mlx_lm

KIB = 1024
TINY_SWA = KVShape("tiny-swa", layers=3, kv_heads=2, head_dim=8, window=16, global_every=3)


def test_shapes_are_benchmarks_md_workloads():
    assert {name: shape.bytes_per_token for name, shape in WORKLOADS.items()} == {
        "llama8b": 128 * KIB,
        "qwen0.5b": 12 * KIB,
        "gemma-swa": 104 * KIB,
    }
    gemma = WORKLOADS["gemma-swa"]
    sliding = [gemma.is_sliding(i) for i in range(gemma.layers)]
    assert sliding[:6] == [True] * 5 + [False]  # 5 of every 6 layers slide
    assert sum(sliding) == 22 and gemma.window == 1024
    assert not any(WORKLOADS["llama8b"].is_sliding(i) for i in range(32))


def test_data_is_seeded_finite_bfloat16():
    a, b = synthetic_kv("qwen0.5b", 40).chunks(3), synthetic_kv("qwen0.5b", 40).chunks(3)
    other = synthetic_kv("qwen0.5b", 40, seed=1).chunks(3)
    (ka, va), (kb, vb), (ko, _) = a[0], b[0], other[0]
    assert ka.dtype == mx.bfloat16 and ka.shape == (1, 2, 40, 64)
    assert mx.array_equal(ka, kb).item() and mx.array_equal(va, vb).item()
    assert not mx.array_equal(ka, va).item() and not mx.array_equal(ka, ko).item()
    magnitude = mx.abs(ka.astype(mx.float32))
    assert mx.min(magnitude).item() >= 0.125 and mx.max(magnitude).item() < 0.5


@needs_tested_mlx_lm
def test_our_caches_and_mlx_lms_hold_the_same_state_after_the_same_prefill():
    kv = SyntheticKV(TINY_SWA, tokens=40)
    ours, theirs = kv.ours(), kv.mlx_lm()
    assert [type(c).__name__ for c in ours] == ["RotatingKVCache", "RotatingKVCache", "KVCache"]
    assert [type(c).__module__ for c in theirs] == ["mlx_lm.models.cache"] * 3
    for mine, peer in zip(ours, theirs):
        assert mine.offset == peer.offset == 40
        for a, b in zip(cache_arrays([mine]), cache_arrays([peer])):
            assert a.dtype == b.dtype and mx.array_equal(a, b).item()
    assert cache_nbytes(ours) == cache_nbytes(theirs)


def test_unknown_workload_and_empty_prompt_are_refused():
    with pytest.raises(
        ValueError, match="Unknown workload 'gpt'; known: llama8b, qwen0.5b, gemma-swa"
    ):
        synthetic_kv("gpt", 512)
    with pytest.raises(ValueError, match="at least one token; received 0"):
        synthetic_kv("llama8b", 0)


@pytest.mark.parametrize(
    ("signature", "windowed"),
    [
        ("kv:plain", "kv:rotating-plain"),
        ("kv:quant:8:64", "kv:rotating-quant:8:64"),
        ("kv:turboquant:3:3", "kv:rotating-turboquant:3:3"),
        ("kv:rotating-quant:4:32", "kv:rotating-quant:4:32"),
    ],
)
def test_windowed_signature(signature, windowed):
    assert windowed_signature(signature) == windowed


def test_a_family_without_a_windowed_counterpart(registries_restored):
    register_family(Family("kv:unwindowed", "a test family with no windowed counterpart"))
    with pytest.raises(ValueError, match="'kv:unwindowed' has no sliding-window family"):
        windowed_signature("kv:unwindowed")


def test_memcpy_case_copies_into_a_buffer_of_that_size():
    case = memcpy_case(4096)
    assert (case.name, case.role) == ("memcpy", "limit")
    case.run()


def test_mlx_lm_save_and_load_cases_round_trip_the_cache(tmp_path):
    caches = SyntheticKV(TINY_SWA, tokens=40).mlx_lm()
    path = tmp_path / "p.safetensors"
    for durable in (False, True):
        save = mlx_lm_save_case(caches, path, durable=durable)
        assert save.name == ("mlx-lm save+fsync" if durable else "mlx-lm save")
        save.run()
        assert path.exists()
        save.reset()
        assert not path.exists()  # each timed save writes a fresh file
    save.run()
    loaded = mlx_lm_load_case(path).run()
    for a, b in zip(cache_arrays(loaded), cache_arrays(caches)):
        assert np.array_equal(np.array(a.astype(mx.float32)), np.array(b.astype(mx.float32)))


def test_attended_arrays_are_the_rows_below_offset_and_leave_a_restores_room_unwritten():
    kv = SyntheticKV(TINY_SWA, tokens=40)
    ours, theirs = kv.ours(), kv.mlx_lm()
    growing = ours[2]  # the global layer: rows in a buffer with room past them
    assert growing.buffers()[0].shape[2] > growing.offset == 40
    growing.leave_unwritten(40)  # as a host restore leaves it
    got = attended_arrays([growing])
    assert growing._unwritten == 40  # its room not zeroed for a reader of its rows
    peer = theirs[2]
    want = [peer.keys[..., :40, :], peer.values[..., :40, :]]
    assert [a.shape for a in got] == [(1, 2, 40, 8)] * 2
    assert all(mx.array_equal(a, b).item() for a, b in zip(got, want))
    # mlx-lm's caches (their buffers' room zeroed): the same rows below their offset.
    held = attended_arrays(theirs)
    assert [a.shape[2] for a in held] == [40] * 6
    assert all(mx.array_equal(a, b).item() for a, b in zip(held[4:], want))
    cache_arrays([growing])  # its state reads the whole buffer: zeroed first
    assert growing._unwritten is None
