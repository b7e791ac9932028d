"""Large values in segment files beside LMDB (kvstore.store.engines.lmdb_values): the same
bytes back as stored inline, LMDB holding pointers only, segments reclaimed once
empty and never reused, readers unaffected by deletions, and damage read as damage."""

from __future__ import annotations

import os
import subprocess
import sys

import lmdb
import pytest

from kvstore.errors import StoreConfigError
from kvstore.store import open_store
from kvstore.store.engines import lmdb_values
from kvstore.store.engines.lmdb_guard import DAMAGED

from .kv_helpers import BLOCK, assert_same_caches, model_for, prompt, token_by_token

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def tiny():
    model = model_for("tiny")
    tokens = prompt(5, 4 * BLOCK + 3)
    return model, tokens, token_by_token(model, tokens)


@pytest.fixture(autouse=True)
def small_values(monkeypatch):
    """The tiny model's records (a few KiB) go to segments, and segments fill quickly."""
    monkeypatch.setattr(lmdb_values, "VALUE_MIN", 1024)
    monkeypatch.setattr(lmdb_values, "SEGMENT_BYTES", 64 << 10)


def _segments(path) -> list[str]:
    directory = path / "values"
    return sorted(os.listdir(directory)) if directory.exists() else []


def _raw_values(store, keys) -> list[bytes | None]:
    """What LMDB itself holds under ``keys`` (through the store's environment)."""
    with store.backend.environment.begin() as txn:
        return [txn.get(k) for k in keys]


def test_a_store_with_segments_restores_what_an_inline_one_does(tmp_path, tiny):
    model, tokens, caches = tiny
    with (
        open_store(f"lmdb://{tmp_path / 'inline'}", block_size=BLOCK) as inline,
        open_store(f"lmdb://{tmp_path / 'seg'}", block_size=BLOCK, values="segments") as seg,
    ):
        want, got = inline.save("ns", tokens, caches), seg.save("ns", tokens, caches)
        assert got == want
        keys = list(got.written)
        assert seg.backend.get_many(keys) == inline.backend.get_many(keys)
        # LMDB holds a pointer per record, the segments the records.
        raw = _raw_values(seg, keys)
        assert all(v is not None and len(v) == lmdb_values.POINTER_BYTES for v in raw)
        assert seg.backend.stats()["segment_bytes"] >= got.written_bytes
        # The segments' own keys are not the store's.
        listed = [k for k, _ in seg.backend.scan(b"")]
        assert listed == [k for k, _ in inline.backend.scan(b"")]
        restored = seg.restore(seg.lookup("ns", tokens), model.make_cache())
        assert_same_caches(restored, token_by_token(model, tokens[:-1]))
        assert seg.verify().clean


def test_another_process_reads_segments_without_the_option(tmp_path, tiny):
    model, tokens, caches = tiny
    path = tmp_path / "s"
    with open_store(f"lmdb://{path}", block_size=BLOCK, values="segments") as store:
        keys = list(store.save("ns", tokens, caches).written)
        want = store.backend.get_many(keys)
    script = (
        "import sys, hashlib\n"
        "from kvstore.store import open_store\n"
        f"store = open_store('lmdb://{path}')\n"
        f"values = store.backend.get_many({keys!r})\n"
        "print(*[hashlib.sha256(v).hexdigest() for v in values])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=True
    )
    import hashlib

    assert out.stdout.split() == [hashlib.sha256(v).hexdigest() for v in want]


def test_inline_and_segment_records_mix_in_one_store(tmp_path, tiny):
    model, tokens, caches = tiny
    url = f"lmdb://{tmp_path / 's'}"
    with open_store(url, block_size=BLOCK) as store:
        store.save("ns", tokens[: 2 * BLOCK], caches)
    with open_store(url, block_size=BLOCK, values="segments") as store:
        got = store.save("ns", tokens, caches)
        assert got.deduplicated == 2
        restored = store.restore(store.lookup("ns", tokens), model.make_cache())
        assert_same_caches(restored, token_by_token(model, tokens[:-1]))
        assert store.verify().clean


def test_emptied_segments_are_unlinked_and_their_numbers_never_reused(tmp_path, tiny):
    model, tokens, caches = tiny
    path = tmp_path / "s"
    with open_store(f"lmdb://{path}", block_size=BLOCK, values="segments") as store:
        store.save("ns", tokens, caches)
        first = _segments(path)
        assert len(first) > 1  # 64 KiB segments: the records filled several
        store.delete("ns")
        # Every segment emptied; the newest stays (its number is the next one's base).
        assert _segments(path) == first[-1:]
        store.save("ns", tokens, caches)
        again = _segments(path)
        assert again[0] == first[-1] and set(again[1:]).isdisjoint(first)
        assert store.stats().blocks == 5
        assert store.verify().clean


def test_a_view_held_across_the_delete_of_its_segment_is_unchanged(tmp_path, tiny):
    model, tokens, caches = tiny
    path = tmp_path / "s"
    url = f"lmdb://{path}"
    with open_store(url, block_size=BLOCK, values="segments") as store:
        keys = list(store.save("ns", tokens, caches).written)
        want = store.backend.get_many(keys)
        with store.backend.view_many(keys) as views:
            with open_store(url, block_size=BLOCK) as other:  # the same process: shared env
                other.delete("ns")
            assert len(_segments(path)) == 1  # the older segments are unlinked
            assert [bytes(v) for v in views] == want
        assert store.backend.get_many(keys) == [None] * len(keys)


def test_a_segment_gone_reads_as_absent_and_a_damaged_one_as_damaged(tmp_path, tiny):
    model, tokens, caches = tiny
    path = tmp_path / "s"
    with open_store(f"lmdb://{path}", block_size=BLOCK, values="segments") as store:
        keys = list(store.save("ns", tokens, caches).written)
    segments = _segments(path)
    # The first segment truncated, the last removed (by hand).
    os.truncate(path / "values" / segments[0], lmdb_values.ALIGN + 100)
    os.unlink(path / "values" / segments[-1])
    with open_store(f"lmdb://{path}", block_size=BLOCK) as store:
        with store.backend.reader() as view:
            values = [view.get(k) for k in keys]
        assert values[0] is DAMAGED  # past the truncated file's end
        assert values[-1] is None  # its segment is gone: absent
        report = store.verify()
        assert keys[0] in report.corrupt
        # The first block reads as damaged: a restore reuses nothing (a recompute).
        restored = store.restore(store.lookup("ns", tokens), model.make_cache())
        assert restored[0].offset == 0


def test_a_flipped_bit_in_a_segment_or_a_pointer_is_caught(tmp_path, tiny):
    model, tokens, caches = tiny
    path = tmp_path / "s"
    with open_store(f"lmdb://{path}", block_size=BLOCK, values="segments") as store:
        keys = list(store.save("ns", tokens, caches).written)
    # A payload byte of the second record, in its segment.
    env = lmdb.open(str(path), subdir=True, lock=False)
    with env.begin() as txn:
        second = lmdb_values.Pointer.decode(txn.get(keys[1]))
        pointer = bytearray(txn.get(keys[2]))
    assert second is not None
    with open(path / "values" / lmdb_values.segment_name(second.segment), "r+b") as f:
        f.seek(second.offset + second.length - 5)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))
    # And a bit of the third record's pointer, in LMDB: it must not read another value.
    pointer[20] ^= 0x01
    with env.begin(write=True) as txn:
        txn.put(keys[2], bytes(pointer))
    env.close()
    with open_store(f"lmdb://{path}", block_size=BLOCK) as store:
        with store.backend.reader() as view:
            assert view.get(keys[2]) is DAMAGED
        report = store.verify()
        assert {keys[1], keys[2]} <= set(report.corrupt)
        # The first block alone is intact: a restore reuses it.
        restored = store.restore(store.lookup("ns", tokens), model.make_cache())
        assert_same_caches(restored, token_by_token(model, tokens[:BLOCK]))
        store.verify(repair=True)
        assert store.verify().clean


def test_values_must_be_inline_or_segments(tmp_path):
    with pytest.raises(StoreConfigError, match="values='pages'"):
        open_store(f"lmdb://{tmp_path / 's'}", values="pages")


def test_a_rebuilt_store_keeps_its_segments(tmp_path, tiny):
    """``kvstore verify --fix`` rebuilds a damaged data.mdb into a fresh directory: the
    segments its pointers refer to come along."""
    from kvstore.store.maintenance.rebuild import rebuild_lmdb

    model, tokens, caches = tiny
    path = tmp_path / "s"
    with open_store(f"lmdb://{path}", block_size=BLOCK, values="segments") as store:
        store.save("ns", tokens, caches)
    before = _segments(path)
    rebuild_lmdb(path)
    assert _segments(path) == before
    with open_store(f"lmdb://{path}", block_size=BLOCK) as store:
        restored = store.restore(store.lookup("ns", tokens), model.make_cache())
        assert_same_caches(restored, token_by_token(model, tokens[:-1]))
        assert store.verify().clean
