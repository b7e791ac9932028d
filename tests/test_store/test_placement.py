"""Records written into the value file while they are being written
(:mod:`kvstore.abc.placement`): the placement as a unit, then real saves whose records
are placed part by part, a part the disk refuses, and a record whose parts moved."""

from __future__ import annotations

import threading

import pytest

from kvstore.abc.placement import Placement
from kvstore.codecs import arena, record
from kvstore.errors import StoreFullError
from kvstore.store import open_store
from kvstore.store.engines import lmdb_values

from .kv_helpers import assert_same_caches, model_for, prefilled
from .kv_helpers import prompt as model_prompt
from .test_value_file import pointers

#: Values of 4 KiB or more go to the file (conftest ``small_values``).
pytestmark = pytest.mark.usefixtures("small_values")


def parts(*chunks: bytes) -> list[tuple[int, memoryview]]:
    out, at = [], 0
    for chunk in chunks:
        out.append((at, memoryview(chunk)))
        at += len(chunk)
    return out


def test_parts_written_before_a_sink_come_at_attach_and_the_rest_as_written():
    placement, got = Placement(), []
    first, second, third = parts(b"aa", b"bbb", b"c")
    placement.written(*first)
    placement.written(*second)
    placement.attach(lambda at, part: got.append((at, bytes(part), threading.get_ident())))
    assert [(at, data) for at, data, _ in got] == [(0, b"aa"), (2, b"bbb")]
    writer = threading.Thread(target=placement.written, args=third)
    writer.start()
    writer.join()
    assert got[-1][:2] == (5, b"c") and got[-1][2] == writer.ident  # on the writer's thread
    placement.detach()
    placement.check()


def test_a_detached_placement_writes_nothing_more_and_a_new_sink_gets_every_part():
    placement, old, new = Placement(), [], []
    first, second = parts(b"head", b"tail")
    placement.attach(lambda at, part: old.append(at))
    placement.written(*first)
    placement.detach()  # the transaction aborted
    placement.written(*second)
    assert old == [0]
    placement.attach(lambda at, part: new.append((at, bytes(part))))  # its retry
    assert new == [(0, b"head"), (4, b"tail")]


def test_a_sinks_error_is_raised_by_check_and_forgotten_by_the_next_sink():
    placement = Placement()

    def refusing(at: int, part: memoryview) -> None:
        raise StoreFullError("[write] The disk is full.")

    placement.attach(refusing)
    placement.written(*parts(b"x")[0])
    placement.detach()
    with pytest.raises(StoreFullError, match="disk is full"):
        placement.check()
    placement.attach(lambda at, part: None)
    placement.check()


@pytest.fixture
def placed_parts(monkeypatch):
    """Saves of a tiny model's caches take the pending path (written on the pool, each
    record placed) and hand their records over in parts of 2 KiB; yields the sinks made."""
    monkeypatch.setattr(arena, "PARALLEL_MIN_BYTES", 0)
    monkeypatch.setattr(record, "PART_BYTES", 2048)
    made: list[int] = []
    sink = lmdb_values.ValueFile.sink

    def counted(self, offset, nbytes):
        made.append(offset)
        return sink(self, offset, nbytes)

    monkeypatch.setattr(lmdb_values.ValueFile, "sink", counted)
    return made


def save_and_restore(path, tokens, **options):
    model = model_for("tiny")
    with open_store(f"lmdb://{path}", block_size=16, touch_interval=0, **options) as store:
        store.save("ns", tokens, prefilled(model, tokens))
        match = store.lookup("ns", [*tokens, 1])
        caches = store.restore(match, model.make_cache())
        report = store.verify()  # its engine part: the value file's space (space_problems)
    return model, caches, report


def test_records_placed_while_they_are_written_restore_bit_for_bit(tmp_path, placed_parts):
    tokens = model_prompt(12, 70)
    model, caches, report = save_and_restore(tmp_path / "s", tokens, values="file")
    assert len(placed_parts) == 5  # every record placed: 70 tokens, 4 blocks of 16 and a tail
    assert sorted(p.offset for p in pointers(tmp_path / "s")) == sorted(placed_parts)
    assert caches[0].offset == len(tokens)
    assert_same_caches(caches, prefilled(model, tokens))
    assert report.clean, report


def test_a_part_the_disk_refuses_fails_the_save_and_leaves_the_store_as_it_was(
    tmp_path, placed_parts, monkeypatch
):
    path = tmp_path / "s"
    kept = model_prompt(3, 40)
    save_and_restore(path, kept, values="file")
    before = sorted(pointers(path), key=lambda p: p.offset)
    sink = lmdb_values.ValueFile.sink

    def refusing_later(self, offset, nbytes):
        write, calls = sink(self, offset, nbytes), []

        def part(at, view):
            calls.append(at)
            if len(calls) > 1:
                raise StoreFullError("[write] The disk is full (injected).")
            write(at, view)

        return part

    monkeypatch.setattr(lmdb_values.ValueFile, "sink", refusing_later)
    model, tokens = model_for("tiny"), model_prompt(4, 70)
    with open_store(f"lmdb://{path}", block_size=16, touch_interval=0) as store:
        with pytest.raises(StoreFullError, match="injected"):
            store.save("ns", tokens, prefilled(model, tokens))
    assert sorted(pointers(path), key=lambda p: p.offset) == before  # nothing committed
    monkeypatch.setattr(lmdb_values.ValueFile, "sink", sink)
    _, caches, report = save_and_restore(path, tokens)  # the space is whole again
    assert_same_caches(caches, prefilled(model, tokens))
    assert report.clean, report


def test_a_record_whose_parts_moved_is_written_whole(tmp_path, placed_parts, monkeypatch):
    written = record.write_record

    def moving(plan, out, *, payload_written=False, placement=None):
        n = written(plan, out, payload_written=payload_written, placement=placement)
        assert placement is not None
        # As when a head packs shorter than planned: bytes handed over do not stay put.
        placement.written(0, memoryview(b"\xff" * n))
        placement.moved = True
        return n

    monkeypatch.setattr(arena, "write_record", moving)
    tokens = model_prompt(5, 70)
    model, caches, report = save_and_restore(tmp_path / "s", tokens, values="file")
    assert placed_parts
    assert_same_caches(caches, prefilled(model, tokens))
    assert report.clean, report


def test_only_a_store_with_a_value_file_places_records(tmp_path, placed_parts):
    tokens = model_prompt(6, 40)
    for url, places in (
        (f"lmdb://{tmp_path / 'file'}?values=file", True),
        (f"lmdb://{tmp_path / 'inline'}?values=inline", False),
        ("memory://placement", False),
    ):
        model = model_for("tiny")
        with open_store(url, block_size=16, touch_interval=0) as store:
            assert store._backend.supports_placement is places
            store.save("ns", tokens, prefilled(model, tokens))
            caches = store.restore(store.lookup("ns", [*tokens, 1]), model.make_cache())
        assert_same_caches(caches, prefilled(model, tokens))
        assert bool(placed_parts) is places
        placed_parts.clear()


def test_the_arena_is_reused_from_save_to_save_with_records_placed(tmp_path, placed_parts):
    """Placements keep views of the records' parts; once a save is committed nothing
    holds them, so the next save writes into the same arena (a new one each save cost a
    GPU save its pinned buffer: 310 ms on an H200)."""
    model = model_for("tiny")
    arenas = []
    with open_store(f"lmdb://{tmp_path / 's'}", block_size=16, values="file") as store:
        for seed in range(3):
            tokens = model_prompt(seed, 70)
            store.save("ns", tokens, prefilled(model, tokens))
            arenas.append(id(arena._arena().array))
    assert len(placed_parts) == 15 and len(set(arenas)) == 1
