"""Large values in a file beside LMDB (``values="file"``, :mod:`kvstore.store.engines.lmdb_values`).

The file's space (allocation, in-place reuse, merging) as a unit; then real stores:
records read back bit for bit (synthetic records and a real model's caches, against
the same saves kept in LMDB's pages), space reused in place but never under an open
read, an aborted write leaving the store as it was, damage to the file, a pointer or
the space record read as damage and never served, and ``verify --fix`` carrying the
file through a rebuild. SIGKILLed writers on the file: ``test_processes.py``.
"""

from __future__ import annotations

import json
import os
import random
import struct
import subprocess
import sys
from pathlib import Path

import lmdb
import pytest

from kvstore.bridge import generate_tokens
from kvstore.cli.output import human_bytes
from kvstore.errors import FormatVersionError, StoreConfigError
from kvstore.store import keys as K
from kvstore.store import open_store
from kvstore.store import settings as settings_module
from kvstore.store.engines.lmdb_values import (
    ALIGN,
    FILE_NAME,
    POINTER_BYTES,
    SPACE_KEY,
    Pointer,
    Space,
    oldest_reader,
    pages,
)
from kvstore.testing.lmdb_pages import flip_bit, read_pages
from kvstore.testing.store import check_match, check_views, encoder_for

from .kv_helpers import BLOCK, CHUNK, assert_same_caches, model_for, prefilled
from .kv_helpers import prompt as model_prompt
from .store_worker import NS, open_, prompt
from .test_damage import run_cli, verify_json
from .test_lmdb import ROOT, killed_reader

#: Records of the synthetic prompts below: ~9 KiB each, over the lowered threshold.
FILLER = 8192


#: Values of 4 KiB or more go to the file (conftest ``small_values``).
pytestmark = pytest.mark.usefixtures("small_values")


def file_store(path: Path, **options):
    return open_(str(path), values="file", **options)


def save_big(store, tokens):
    return store.put_blocks(NS, tokens, encoder_for(tokens, filler=FILLER))


def pointers(path: Path) -> list[Pointer]:
    """Every pointer LMDB holds (read with python-lmdb directly, through the environment
    this process has open on ``path`` if any: python-lmdb opens one per process)."""
    from kvstore.store.engines.lmdb_env import SharedEnv

    shared = SharedEnv._open.get(str(path.resolve()))
    env = shared.env if shared is not None else lmdb.open(str(path), readonly=True, lock=False)
    try:
        with env.begin() as txn:
            found = [Pointer.decode(v) for _, v in txn.cursor() if Pointer.looks_like(v)]
    finally:
        if shared is None:
            env.close()
    assert all(p is not None for p in found)
    return found  # type: ignore[return-value]


def raw_value(path: Path, key: bytes) -> bytes | None:
    """``key``'s value as LMDB holds it (read with python-lmdb directly)."""
    env = lmdb.open(str(path), readonly=True, lock=False)
    try:
        with env.begin() as txn:
            return txn.get(key)
    finally:
        env.close()


def flip_a_pointer(txn) -> None:
    """Flip the last bit of the first pointer LMDB holds (for :func:`raw_lmdb`)."""
    for key, value in txn.cursor():
        if Pointer.looks_like(value):
            txn.put(key, bytes(value[:-1]) + bytes([value[-1] ^ 1]))
            return


def raw_lmdb(path: Path, change) -> None:
    env = lmdb.open(str(path), subdir=True)
    try:
        with env.begin(write=True) as txn:
            change(txn)
    finally:
        env.close()


def assert_read_stops_at_the_damage(store, match, tokens):
    """A read of ``match`` serves the blocks before the damaged one, bit for bit, and
    none from it on."""
    with store.read(match.blocks) as views:
        assert len(views) < len(match.blocks)
        if views:
            check_views(views, match.truncated(match.blocks[len(views)].start), tokens)


# -- the file's space, alone ----------------------------------------------------------------
def test_space_allocates_at_the_end_then_reuses_what_readers_no_longer_see():
    space = Space()
    first = space.allocate(5000, lambda freed: True)
    second = space.allocate(ALIGN, lambda freed: True)
    assert (first, second, space.end) == (ALIGN, 3 * ALIGN, 4 * ALIGN)
    space.release(first, 5000, freed_by=7)
    assert space.free == [(ALIGN, 2 * ALIGN, 7)]
    # Not while a reader may still see it: the end instead.
    assert space.allocate(ALIGN, lambda freed: freed < 7) == 4 * ALIGN
    assert space.allocate(ALIGN, lambda freed: freed <= 7) == ALIGN  # split: the rest stays
    assert space.free == [(2 * ALIGN, ALIGN, 7)]


def test_space_joins_neighbours_once_both_may_be_reused():
    space = Space(end=10 * ALIGN)
    space.release(2 * ALIGN, ALIGN, freed_by=3)
    space.release(3 * ALIGN, ALIGN, freed_by=3)  # the same transaction's: one extent
    space.release(5 * ALIGN, ALIGN, freed_by=5)
    space.release(4 * ALIGN, ALIGN, freed_by=4)
    assert space.free == [(2 * ALIGN, 2 * ALIGN, 3), (4 * ALIGN, ALIGN, 4), (5 * ALIGN, ALIGN, 5)]
    assert Space.decode(space.encode()).free == space.free
    # Transaction 5 frees beside what 3 and 4 freed: their space is reused all the same
    # (joined under 5 it would wait for 5's readers), and joined once 5's may be too.
    assert space.allocate(2 * ALIGN, lambda freed: freed < 5) == 2 * ALIGN
    assert space.free == [(4 * ALIGN, ALIGN, 4), (5 * ALIGN, ALIGN, 5)]
    assert space.allocate(2 * ALIGN, lambda freed: freed < 5) == 10 * ALIGN  # the end
    assert space.allocate(2 * ALIGN, lambda freed: freed <= 5) == 4 * ALIGN
    assert space.free == []


def test_space_gives_back_the_free_extents_that_end_it_once_no_reader_sees_them():
    space = Space(end=10 * ALIGN)
    space.release(2 * ALIGN, ALIGN, freed_by=3)  # inside: stays free for later values
    space.release(6 * ALIGN, 2 * ALIGN, freed_by=4)
    space.release(8 * ALIGN, 2 * ALIGN, freed_by=5)  # ends the file
    assert space.ends_free
    assert not space.give_back_end(lambda freed: freed < 5)  # a reader may see 5's
    assert (space.end, len(space.free)) == (10 * ALIGN, 3)
    assert space.give_back_end(lambda freed: freed <= 5)  # both, though apart
    assert (space.end, space.free) == (6 * ALIGN, [(2 * ALIGN, ALIGN, 3)])
    assert not space.ends_free and not space.give_back_end(lambda freed: True)
    assert Space.decode(space.encode()).end == 6 * ALIGN
    everything = Space(end=4 * ALIGN, free=[(ALIGN, 3 * ALIGN, 1)])
    assert everything.give_back_end(lambda freed: True)
    assert (everything.end, everything.free) == (ALIGN, [])  # the header stays


def test_a_damaged_space_record_decodes_as_none():
    raw = bytearray(Space(end=9 * ALIGN, free=[(ALIGN, ALIGN, 2)]).encode())
    assert Space.decode(bytes(raw)) is not None
    for at in range(len(raw)):
        flipped = bytearray(raw)
        flipped[at] ^= 0x10
        assert Space.decode(bytes(flipped)) is None, at
    assert Space.decode(b"") is None


def test_a_pointer_with_a_flipped_bit_decodes_as_none():
    raw = Pointer(salt=99, offset=ALIGN, length=12345).encode()
    assert len(raw) == POINTER_BYTES and Pointer.decode(raw) == Pointer(99, ALIGN, 12345)
    for at in range(len(raw)):
        flipped = bytearray(raw)
        flipped[at] ^= 0x01
        assert Pointer.decode(bytes(flipped)) is None, at


def test_the_oldest_reader_comes_from_lmdbs_reader_table(tmp_path):
    env = lmdb.open(str(tmp_path))
    with env.begin(write=True) as txn:
        txn.put(b"k", b"v")
    assert oldest_reader(env.readers()) is None
    held = env.begin()
    with env.begin(write=True) as txn:
        txn.put(b"k", b"w")
    assert oldest_reader(env.readers()) == held.id() == 1
    held.abort()
    env.close()


# -- stores ---------------------------------------------------------------------------------
def test_records_round_trip_through_the_file_and_lmdb_holds_pointers(tmp_path):
    path = tmp_path / "s"
    with file_store(path) as store:
        prompts = [prompt(1, i) for i in range(6)]
        for tokens in prompts:
            save_big(store, tokens)
        for tokens in prompts:
            check_match(store, store.lookup(NS, tokens), tokens)
        assert store.verify().clean
    found = pointers(path)
    assert found and (path / FILE_NAME).stat().st_size >= sum(p.length for p in found)
    with open_(str(path)) as store:  # read back by a store opened without the option
        for tokens in prompts:
            check_match(store, store.lookup(NS, tokens), tokens)


def test_where_the_os_has_no_fdatasync_the_values_are_fsynced(tmp_path, monkeypatch):
    # macOS: Python has no os.fdatasync there, and a synced save into the file raised.
    monkeypatch.delattr(os, "fdatasync")
    synced, fsync = [], os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(os.fstat(fd).st_ino) or fsync(fd))
    path = tmp_path / "s"
    with file_store(path) as store:
        prompts = [prompt(1, i) for i in range(3)]
        for tokens in prompts:
            assert save_big(store, tokens).written
    # Each save's values, synced before LMDB committed their pointers.
    assert synced.count((path / FILE_NAME).stat().st_ino) >= len(prompts)
    with file_store(path) as store:
        for tokens in prompts:
            check_match(store, store.lookup(NS, tokens), tokens)


def test_space_is_reused_in_place_once_deleted(tmp_path):
    path = tmp_path / "s"
    with file_store(path) as store:
        save_big(store, prompt(2, 0))
        size = (path / FILE_NAME).stat().st_size
        used = sorted(p.offset for p in pointers(path))
        for round_ in range(1, 4):
            store.delete(NS)
            save_big(store, [t + round_ for t in prompt(2, 0)])  # a new prompt, same sizes
            assert (path / FILE_NAME).stat().st_size == size
            assert sorted(p.offset for p in pointers(path)) == used


def test_a_store_kept_to_its_budget_keeps_its_file_near_it(tmp_path):
    """A save over its budget evicts before it allocates, in one transaction: what it
    evicts beside free space must not keep that space from it (the file grew without
    end, 8x the budget after 600 saves, before eviction's frees stayed apart)."""
    path, budget, rng = tmp_path / "s", 400 << 10, random.Random(5)
    sizes = []
    with file_store(path, max_bytes=budget) as store:
        for _ in range(240):
            save_big(store, [rng.randrange(1000) for _ in range(rng.randrange(17, 120))])
            sizes.append((path / FILE_NAME).stat().st_size)
        assert store.verify().clean
    assert sum(p.length for p in pointers(path)) <= budget
    settled = [pages(size) for size in sizes[len(sizes) // 3 :]]
    assert max(settled) <= 2 * budget, [s >> 10 for s in sizes[::20]]  # not grown since
    assert min(settled) < max(settled)  # its free end given back as the store shrank


def test_space_a_reader_may_still_see_is_never_written(tmp_path):
    path = tmp_path / "s"
    with file_store(path) as store:
        old = prompt(3, 0)
        save_big(store, old)
        match = store.lookup(NS, old)
        size = (path / FILE_NAME).stat().st_size
        with store.read(match.blocks) as views:  # a read transaction holds the old records
            store.delete(NS)
            new = [t + 1 for t in old]
            save_big(store, new)
            assert (path / FILE_NAME).stat().st_size > size  # written past the end
            check_views(views, match, old)  # the held bytes did not change
        check_match(store, store.lookup(NS, new), new)
        store.delete(NS)
        save_big(store, old)  # no reader now: into freed space, the file no longer grows
        grown = (path / FILE_NAME).stat().st_size
        store.delete(NS)
        save_big(store, new)
        assert (path / FILE_NAME).stat().st_size == grown
        check_match(store, store.lookup(NS, new), new)


def test_a_store_that_shrinks_gives_its_file_s_free_end_back(tmp_path):
    # Freed space at the file's end is cut off by a later write, once no read can
    # still see it (never in the transaction that frees it: its readers may): the file
    # follows the store down, not only up. Space freed inside it stays for reuse.
    path = tmp_path / "s"
    prompts = [[base + i for i in range(48)] for base in (100, 200, 300)]
    ends = []  # where each prompt's records end in the file, saved one after the other
    with file_store(path) as store:
        for tokens in prompts:
            before = {p.offset for p in pointers(path)}
            save_big(store, tokens)
            ends.append(
                max(p.offset + pages(p.length) for p in pointers(path) if p.offset not in before)
            )
        first, second, third = prompts
        assert ends == sorted(ends) and pages((path / FILE_NAME).stat().st_size) == ends[2]
        match = store.lookup(NS, third)
        with store.read(match.blocks) as views:  # a read holds the file's last records
            store.delete(NS, third[:1])  # every block of it
            store.delete(NS, first[:1])  # writes the space: the held end is not cut
            assert pages((path / FILE_NAME).stat().st_size) == ends[2]
            check_views(views, match, third)
        store.delete(NS, second[:1])  # the reader is gone: third's pages go back
        assert (path / FILE_NAME).stat().st_size == ends[1]
        save_big(store, first)  # into first's freed pages; second's now end the file
        assert (path / FILE_NAME).stat().st_size == ends[0]
        check_match(store, store.lookup(NS, first), first)
        assert store.verify().clean
    with file_store(path) as store:
        check_match(store, store.lookup(NS, first), first)
        assert store.verify().clean


def test_a_read_in_another_process_keeps_the_file_s_end_until_it_ends(tmp_path):
    # LMDB's reader table holds every process's reads: the end a read elsewhere still
    # sees is not cut, and its bytes do not change; once that read ends, it goes.
    path = tmp_path / "s"
    prompts = [[base + i for i in range(48)] for base in (100, 200, 300)]
    with file_store(path) as store:
        for tokens in prompts:
            save_big(store, tokens)
    full = (path / FILE_NAME).stat().st_size
    reader = subprocess.Popen(
        [sys.executable, "-m", "tests.test_store.store_worker", "read_hold", str(path), "300"],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert reader.stdout.readline().split() == ["READING", "3"]
        with file_store(path) as store:
            store.delete(NS, prompts[2][:1])
            assert store.backend.give_back_space() == 0  # the reader still sees it
            assert (path / FILE_NAME).stat().st_size == full
            out, _ = reader.communicate("", timeout=60)
            assert out.split() == ["SAME"] and reader.returncode == 0
            assert store.backend.give_back_space() > 0  # the read ended: it goes
            assert (path / FILE_NAME).stat().st_size < full
            assert store.verify().clean
            check_match(store, store.lookup(NS, prompts[1]), prompts[1])
    finally:
        reader.kill()


@pytest.mark.parametrize("command", ["gc", "delete"])
def test_gc_and_delete_give_the_file_s_freed_end_back_at_once(tmp_path, capsys, command):
    # A maintenance command frees, then gives the file's end back in a transaction of
    # its own: the disk space returns now, not at the store's next write.
    path = tmp_path / "s"
    with file_store(path) as store:
        for base in (100, 200):
            save_big(store, [base + i for i in range(48)])
    size = (path / FILE_NAME).stat().st_size
    args = ["--max-bytes", "1"] if command == "gc" else ["-n", NS]
    status, out, err = run_cli(capsys, command, str(path), *args, "--json")
    assert status == 0, err
    assert (path / FILE_NAME).stat().st_size == ALIGN  # the header alone
    assert json.loads(out)["file_bytes_given_back"] == size - ALIGN
    again = [100 + i for i in range(48)]
    with file_store(path) as store:
        written = store.backend.environment.info()["last_txnid"]
        assert store.verify().clean and store.backend.give_back_space() == 0
        assert store.backend.environment.info()["last_txnid"] == written  # nothing to cut
        save_big(store, again)
        check_match(store, store.lookup(NS, again), again)


def test_engines_without_a_value_file_give_nothing_back():
    with open_store("memory://") as store:
        assert store.backend.give_back_space() == 0


def test_a_reader_killed_inside_its_snapshot_does_not_pin_the_space_forever(tmp_path):
    # A process SIGKILLed inside a read transaction leaves its slot in LMDB's reader
    # table. A long-running writer (the store open all along) clears such slots before
    # it asks which freed space it may write, or the file would grow at every save.
    path = tmp_path / "s"
    with file_store(path) as store:
        old = prompt(4, 0)
        save_big(store, old)
        size = (path / FILE_NAME).stat().st_size
        with killed_reader(store, path):
            pass
        store.delete(NS)
        new = [t + 1 for t in old]
        save_big(store, new)  # the dead reader's snapshot no longer counts
        assert (path / FILE_NAME).stat().st_size == size
        check_match(store, store.lookup(NS, new), new)


def test_an_aborted_write_leaves_the_store_and_its_space_as_they_were(tmp_path):
    path = tmp_path / "s"
    with file_store(path) as store:
        kept = prompt(4, 0)
        save_big(store, kept)
        before = sorted(pointers(path), key=lambda p: p.offset)
        tokens = prompt(4, 1)
        good = encoder_for(tokens, filler=FILLER)

        def failing(spans):
            records = good(spans)
            records[-1] = None  # python-lmdb refuses it after the others were written
            return records

        with pytest.raises(Exception):  # noqa: B017 - whichever error the bad value raises
            store.put_blocks(NS, tokens, failing)
        assert sorted(pointers(path), key=lambda p: p.offset) == before
        check_match(store, store.lookup(NS, kept), kept)
        save_big(store, tokens)
        check_match(store, store.lookup(NS, tokens), tokens)
        assert store.verify().clean


def test_a_flipped_bit_in_the_file_is_a_corrupt_record_never_served(tmp_path):
    path = tmp_path / "s"
    tokens = prompt(5, 0)
    with file_store(path) as store:
        save_big(store, tokens)
    victim = min(pointers(path), key=lambda p: p.offset)
    flip_bit(str(path / FILE_NAME), victim.offset + victim.length // 2, 3)
    with file_store(path) as store:
        match = store.lookup(NS, tokens)
        assert_read_stops_at_the_damage(store, match, tokens)
        report = store.verify()
        assert len(report.corrupt) == 1


@pytest.mark.parametrize("damage", ["truncated", "missing", "replaced", "pointer"])
def test_a_damaged_file_or_pointer_reads_as_damage_without_a_crash(tmp_path, damage):
    path = tmp_path / "s"
    tokens = prompt(6, 0)
    with file_store(path) as store:
        save_big(store, tokens)
    file = path / FILE_NAME
    if damage == "truncated":
        os.truncate(file, ALIGN + 10)
    elif damage == "missing":
        file.unlink()
    elif damage == "replaced":  # another file of that name: its salt differs
        file.unlink()
        with file_store(tmp_path / "other") as other:
            save_big(other, prompt(6, 1))
        os.link(tmp_path / "other" / FILE_NAME, file)
    else:
        raw_lmdb(path, flip_a_pointer)
    with open_(str(path)) as store:
        assert_read_stops_at_the_damage(store, store.lookup(NS, tokens), tokens)
        report = store.verify()
        assert report.corrupt and not report.clean


def test_a_damaged_space_record_never_lets_a_write_overwrite_a_value(tmp_path):
    path = tmp_path / "s"
    kept = prompt(7, 0)
    with file_store(path) as store:
        save_big(store, kept)
        save_big(store, prompt(7, 1))
        store.delete(NS)
        save_big(store, kept)  # into the freed space: it is on the free list now

    def damage(txn):
        raw = bytearray(txn.get(SPACE_KEY))
        raw[len(raw) // 2] ^= 0xFF
        txn.put(SPACE_KEY, bytes(raw))

    raw_lmdb(path, damage)
    size = (path / FILE_NAME).stat().st_size
    with file_store(path) as store:
        fresh = prompt(7, 2)
        save_big(store, fresh)  # "everything taken": appended
        assert min(p.offset for p in pointers(path)) < size <= max(p.offset for p in pointers(path))
        check_match(store, store.lookup(NS, kept), kept)
        check_match(store, store.lookup(NS, fresh), fresh)


def meta_format(path: Path) -> int:
    """The format of the store's settings record (kvstore.store.settings)."""
    return struct.unpack_from("<H", raw_value(path, K.META_KEYS[0]), 4)[0]


def test_a_new_store_keeps_its_large_values_in_the_file_as_format_3(tmp_path):
    path = tmp_path / "s"
    with open_(str(path)) as store:
        assert store.settings.values == "file"
        save_big(store, prompt(8, 2))
    assert pointers(path) and meta_format(path) == 3


def test_a_store_created_inline_stays_inline_and_format_2(tmp_path):
    path = tmp_path / "s"
    with open_(str(path), values="inline") as store:
        save_big(store, prompt(8, 0))
    with pytest.raises(StoreConfigError, match="values was fixed when the store was created"):
        open_(str(path), values="file")
    with open_(str(path)) as store:  # the stored setting, not the default for new stores
        assert store.settings.values == "inline"
        save_big(store, prompt(8, 1))
    assert not (path / FILE_NAME).exists() and meta_format(path) == 2


def test_a_reader_of_format_2_refuses_a_value_file_store_as_newer(tmp_path, monkeypatch):
    path = tmp_path / "s"
    with open_(str(path)) as store:
        save_big(store, prompt(8, 3))
    monkeypatch.setattr(settings_module, "META_FORMAT", 2)  # what kvstores before it read
    with pytest.raises(FormatVersionError, match="store format 3, newer than this reader"):
        open_(str(path))


def test_a_store_may_hold_values_of_both_kinds(tmp_path):
    path = tmp_path / "s"
    inline, in_file = prompt(8, 0), prompt(8, 1)
    with open_(str(path), values="inline") as store:
        save_big(store, inline)
        store._backend.write_values_to("file")  # as a store recovered from its blocks does
        save_big(store, in_file)
        for tokens in (inline, in_file):
            check_match(store, store.lookup(NS, tokens), tokens)
    with open_(str(path)) as store:  # the file is there: its values may be in it
        assert store.settings.values == "file"
        for tokens in (inline, in_file):
            check_match(store, store.lookup(NS, tokens), tokens)
        store.delete(NS)  # frees the file's space
        assert store.verify().clean
    space = Space.decode(raw_value(path, SPACE_KEY))
    assert space is not None and sum(n for _, n, _ in space.free) == space.end - ALIGN


def test_an_unknown_values_setting_is_refused(tmp_path):
    with pytest.raises(StoreConfigError, match="values must be 'inline' or 'file'"):
        open_store(f"lmdb://{tmp_path / 's'}", values="segments")
    with pytest.raises(StoreConfigError, match="values='file' needs a backend that keeps"):
        open_store("memory://", values="file")


def test_a_models_caches_restore_bit_for_bit_from_the_file(tmp_path):
    model = model_for("tiny")
    tokens = model_prompt(12, 70)
    for values in ("file", "inline"):
        url = f"lmdb://{tmp_path / values}"
        with open_store(url, block_size=16, touch_interval=0, values=values) as store:
            generate_tokens(model, tokens, store=store, max_tokens=1, chunk_size=CHUNK)
            match = store.lookup(store_namespace(model), [*tokens, 1])
            caches = store.restore(match, model.make_cache())
        assert caches[0].offset == len(tokens)
        assert_same_caches(caches, prefilled(model, tokens))
    assert pointers(tmp_path / "file") and not (tmp_path / "inline" / FILE_NAME).exists()


def test_migrate_in_place_gives_a_files_freed_space_back(tmp_path, capsys):
    # Space freed inside the file stays free for later values (only its free end is
    # given back as the store writes); a migration copies the live records into a new
    # store, whose file holds them alone.
    model = model_for("tiny")
    kept, dropped = model_prompt(12, 70), model_prompt(13, 70)
    path = tmp_path / "s"
    with open_store(f"lmdb://{path}", block_size=16, touch_interval=0) as store:
        store.save(store_namespace(model), kept, prefilled(model, kept))
        store.save("dropped", dropped, prefilled(model, dropped))
        store.delete("dropped")
    high = (path / FILE_NAME).stat().st_size
    live = sum(p.length for p in pointers(path))
    assert high > 1.5 * live  # half of it free, kept
    status, out, err = run_cli(capsys, "migrate", str(path), "--in-place", "--no-progress")
    assert status == 0, err
    assert (path / FILE_NAME).stat().st_size < high and sum(
        p.length for p in pointers(path)
    ) == live
    with open_store(f"lmdb://{path}", touch_interval=0) as store:
        caches = store.restore(store.lookup(store_namespace(model), [*kept, 1]), model.make_cache())
        assert store.verify().clean
    assert_same_caches(caches, prefilled(model, kept))


def store_namespace(model):
    from kvstore.bridge.namespace import namespace_for_model

    return namespace_for_model(model)


def test_verify_fix_rebuilds_a_damaged_file_and_keeps_the_value_file(tmp_path, capsys):
    # test_damage's branch-page damage, on a store whose records are all in the file.
    path, model = tmp_path / "s", model_for("tiny")
    url = f"lmdb://{path}"
    with open_store(url, block_size=BLOCK, touch_interval=0, values="file") as store:
        for seed in range(12):  # enough keys for a branch page
            generate_tokens(model, model_prompt(100 + seed, 40), store=store, max_tokens=1)
    assert len(pointers(path)) >= 12
    _, pages = read_pages(str(path / "data.mdb"))
    branch = next(p for p in pages if p.kind == "branch")
    data = (path / "data.mdb").read_bytes()
    lower = struct.unpack_from("<H", data, branch.offset + 12)[0]
    last = struct.unpack_from("<H", data, branch.offset + lower - 2)[0]
    flip_bit(str(path / "data.mdb"), branch.offset + last, 0)
    status, out, _ = run_cli(capsys, "verify", str(path), "--fix")
    assert status == 0 and "rebuilt the damaged file" in out, out
    status, report = verify_json(capsys, str(path))
    assert status == 0 and report["clean"], report
    assert pointers(path)  # the records the damage spared, still in the linked file
    tokens = model_prompt(100, 40)
    with open_store(url, touch_interval=0) as store:
        generate_tokens(model, tokens, store=store, max_tokens=1, chunk_size=CHUNK)
        match = store.lookup(store_namespace(model), [*tokens, 1])
        caches = store.restore(match, model.make_cache())
    assert caches[0].offset == len(tokens)
    assert_same_caches(caches, prefilled(model, tokens))


def test_space_marked_free_under_a_value_is_found_and_mended(tmp_path):
    # A space record with a valid checksum that frees a live value's pages (a buggy
    # writer): verify reports it as the engine's damage, repair rewrites the space from
    # the live values, and the next saves write elsewhere.
    path = tmp_path / "s"
    kept = prompt(10, 0)
    with file_store(path) as store:
        save_big(store, kept)
    victim = min(pointers(path), key=lambda p: p.offset)

    def free_it(txn):
        space = Space.decode(txn.get(SPACE_KEY))
        space.release(victim.offset, victim.length, freed_by=1)
        txn.put(SPACE_KEY, space.encode())

    raw_lmdb(path, free_it)
    with file_store(path) as store:
        report = store.verify()
        assert any("overlaps" in p for p in report.engine), report.engine
        assert store.verify(repair=True).repaired and store.verify().clean
        for seed in range(1, 4):
            save_big(store, prompt(10, seed))
        check_match(store, store.lookup(NS, kept), kept)


def test_a_damaged_pointer_repaired_leaves_no_space_behind(tmp_path):
    path = tmp_path / "s"
    with file_store(path) as store:
        save_big(store, prompt(11, 0))

    raw_lmdb(path, flip_a_pointer)
    with file_store(path) as store:
        assert not store.verify().clean
        store.verify(repair=True)  # the damaged block goes; its pages stayed taken
        assert store.verify().clean  # ... and the engine's repair freed them
        size = (path / FILE_NAME).stat().st_size
        save_big(store, prompt(11, 0))
        assert (path / FILE_NAME).stat().st_size == size  # into the freed pages
        check_match(store, store.lookup(NS, prompt(11, 0)), prompt(11, 0))


def test_stats_name_the_value_file_s_bytes_and_its_free_space(tmp_path, capsys):
    path = tmp_path / "s"
    with file_store(path) as store:
        save_big(store, prompt(12, 0))
        engine = store.stats().backend
        assert (engine["value_file_free_bytes"], engine["value_file_free_extents"]) == (0, 0)
        held = sum(pages(p.length) for p in pointers(path))
        store.delete(NS)  # every value's pages freed by one transaction: one extent
        freed = store.stats().backend
    assert engine["value_file_bytes"] == (path / FILE_NAME).stat().st_size > ALIGN
    assert (freed["value_file_free_bytes"], freed["value_file_free_extents"]) == (held, 1)
    status, out, _ = run_cli(capsys, "stats", str(path))
    assert status == 0 and "value file size" in out
    line = next(line for line in out.splitlines() if line.startswith("value file free"))
    assert line.split(None, 3)[3] == (
        f"{human_bytes(held)} in 1 extent, reused by later saves; the file's free end is "
        f"given back by the next write (`kvstore migrate {path} --in-place` gives back all "
        f"of it)"
    )


def test_a_reader_drops_the_mappings_no_view_holds_as_the_file_grows(tmp_path):
    path = tmp_path / "s"
    with file_store(path) as store:
        values = store._backend._shared.values
        first = prompt(13, 0)
        save_big(store, first)
        with store.read(store.lookup(NS, first).blocks) as views:
            assert views and len(values._maps) == 1
            held = values._maps[0]
            for seed in range(1, 4):  # the file grows past the mapping while a view holds it
                tokens = prompt(13, seed)
                save_big(store, tokens)
                check_match(store, store.lookup(NS, tokens), tokens)
            assert held in values._maps and not held.closed  # its views still read
            check_views(views, store.lookup(NS, first), first)
        more = prompt(13, 9)
        save_big(store, more)
        check_match(store, store.lookup(NS, more), more)
        assert held not in values._maps and len(values._maps) == 1
