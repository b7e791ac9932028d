"""Checking many records at once (``kvstore.store.blocks.checks``), and restores through the
paths large reads take (records checked on two threads, arrays filled by MLX's loader)."""

from __future__ import annotations

import pytest

from kvstore.caches import KVCache
from kvstore.codecs import cuda, fill, snapshot
from kvstore.codecs.record import encode_record, forget_parsed_headers, verify_record
from kvstore.errors import CorruptEntryError, FormatVersionError
from kvstore.store.blocks import checks
from kvstore.store.blocks.checks import check_records
from kvstore.testing.codec import fill_cache

from .kv_helpers import assert_same_caches, prompt
from .test_kv import lmdb_url, saved_and_restored

__all__ = ["lmdb_url"]  # the fixture, shared with test_kv


@pytest.fixture(params=["one thread", "two threads"])
def threads(request, monkeypatch):
    if request.param == "two threads":
        monkeypatch.setattr(checks, "PARALLEL_MIN_BYTES", 0)
    return request.param


def records(n: int) -> list[memoryview]:
    out = []
    for i in range(n):
        cache = KVCache()
        fill_cache(cache, [4], seed=i)
        out.append(memoryview(bytearray(encode_record([snapshot(cache)]))))
    return out


def flip_last_byte(record: memoryview) -> None:
    record[-1] ^= 0x01


def test_intact_records_all_pass(threads):
    assert check_records(verify_record, records(6)) == [None] * 6


def test_checks_stop_at_the_first_bad_record_and_report_it(threads):
    found = records(6)
    flip_last_byte(found[3])
    flip_last_byte(found[5])
    forget_parsed_headers()
    verdicts = check_records(verify_record, found)
    assert len(verdicts) == 4 and verdicts[:3] == [None] * 3
    assert isinstance(verdicts[3], CorruptEntryError)


def test_a_newer_format_is_a_verdict_and_other_errors_propagate(threads):
    def verify(record: memoryview) -> None:
        if record[0] == 1:
            raise FormatVersionError("[verify] format 9 is newer than this reader")
        if record[0] == 2:
            raise RuntimeError("disk on fire")

    ones = [memoryview(bytes([0])), memoryview(bytes([1])), memoryview(bytes([0]))]
    verdicts = check_records(verify, ones)
    assert len(verdicts) == 2 and isinstance(verdicts[1], FormatVersionError)
    with pytest.raises(RuntimeError, match="disk on fire"):
        check_records(verify, [memoryview(bytes([0])), memoryview(bytes([2]))])


@pytest.mark.parametrize("family", ["plain", "quant", "window"])
def test_restores_through_the_large_read_paths_are_bit_exact(family, lmdb_url, monkeypatch):
    monkeypatch.setattr(checks, "PARALLEL_MIN_BYTES", 0)
    monkeypatch.setattr(fill, "DIRECT_MIN_BYTES", 0)
    streams = []

    class Recorded(fill.LeafStream):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            streams.append(self)

    monkeypatch.setattr(fill, "LeafStream", Recorded)
    _, expected, restored = saved_and_restored(lmdb_url, family, prompt(31, 70))
    assert restored[0].offset == 70
    assert len(streams) == 1 and streams[0].complete  # filled by the loader, no fallback
    assert_same_caches(restored, expected)


@pytest.mark.parametrize(
    ("cores", "on_gpu", "setting", "want"),
    [
        (16, False, None, 16),  # every core hashes
        (64, False, None, 16),  # at most 16
        (2, False, None, 2),
        (16, True, None, 12),  # 4 threads lock pages meanwhile: 12 left
        (5, True, None, 2),  # at least 2
        (16, True, "6", 6),
    ],
)
def test_the_checking_threads_are_the_cores_the_page_locking_leaves(
    monkeypatch, cores, on_gpu, setting, want
):
    monkeypatch.setattr(checks, "cores", lambda: cores)
    monkeypatch.setattr(cuda, "in_use", lambda: on_gpu)
    monkeypatch.delenv("KVSTORE_CUDA_REGISTER_THREADS", raising=False)
    if setting is None:
        monkeypatch.delenv("KVSTORE_VERIFY_THREADS", raising=False)
    else:
        monkeypatch.setenv("KVSTORE_VERIFY_THREADS", setting)
    assert checks._workers() == want


@pytest.mark.parametrize("setting", ["0", "-3", "four"])
def test_a_thread_count_that_is_not_positive_is_refused_by_name(monkeypatch, setting):
    monkeypatch.setenv("KVSTORE_VERIFY_THREADS", setting)
    want = f"KVSTORE_VERIFY_THREADS='{setting}': expected a positive number of threads"
    with pytest.raises(ValueError, match=want):
        checks._workers()


def test_page_locking_threads_set_by_the_environment_leave_the_rest_to_the_checks(monkeypatch):
    monkeypatch.setattr(checks, "cores", lambda: 16)
    monkeypatch.setattr(cuda, "in_use", lambda: True)
    monkeypatch.delenv("KVSTORE_VERIFY_THREADS", raising=False)
    monkeypatch.setenv("KVSTORE_CUDA_REGISTER_THREADS", "6")
    assert checks._workers() == 10
