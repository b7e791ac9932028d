"""The ``copy`` route of kvstore.codecs.cuda_pages (``KVSTORE_CUDA_PAGES_ROUTE=copy``): a
restore's records reach the device through the staging slots, a chunk per staging thread,
no page locked. With the transport swapped for host memory (tests.test_codecs
.test_cuda_staging.HostTransport: a copy must come from a pinned slot, a gather read only
the device memory): restores through it equal the CPU's bit for bit, and whatever fails
leaves the rows to the plain path and nothing held."""

from __future__ import annotations

import mmap
import queue
import sys
import threading

import numpy as np
import pytest

from kvstore.codecs import cuda, cuda_pages
from kvstore.store import open_store
from kvstore.threads import KeptPool
from tests.test_codecs.test_cuda_pages import plain_prefix
from tests.test_codecs.test_cuda_staging import HostTransport
from tests.test_store.kv_helpers import (
    BLOCK,
    FAMILIES,
    assert_same_caches,
    model_for,
    prefilled,
    prompt,
    token_by_token,
)

PAGE = mmap.PAGESIZE


def fresh_slots(monkeypatch) -> None:
    """No staging slot made yet in this process (each test's transport makes its own)."""
    monkeypatch.setattr(cuda, "_FREE", queue.SimpleQueue())
    monkeypatch.setattr(cuda, "_SLOTS_MADE", False)
    monkeypatch.setattr(cuda, "_SLOTS_READY", threading.Event())


@pytest.fixture
def copying(monkeypatch):
    """A host-memory transport, the ``copy`` route asked for, its slots made, and
    chunks of two pages (a record of these tiny models is cut into several)."""
    transport = HostTransport()
    monkeypatch.setattr(cuda, "TRANSPORT", transport)
    monkeypatch.setattr(cuda_pages, "PAGES_ROUTE", "copy")
    monkeypatch.setattr(cuda_pages, "STAGE_SPANS", True)
    monkeypatch.setattr(cuda_pages, "LOCK_SPANS", "0")
    monkeypatch.setattr(cuda_pages, "COPY_CHUNK_BYTES", 2 * PAGE)
    monkeypatch.setattr(cuda_pages, "GATHER_MIN_BYTES", 0)
    monkeypatch.setattr(cuda_pages, "_WORKS", None)
    monkeypatch.setattr(cuda_pages, "_WORKS_FUTURE", None)
    fresh_slots(monkeypatch)
    assert cuda_pages._works()
    cuda._prepare_slots()
    assert cuda.slots_ready()
    cuda_pages.settle()
    transport.gathers = transport.registrations = 0
    transport.stagings.clear()
    yield transport
    cuda_pages.settle()
    monkeypatch.setattr(cuda, "TRANSPORT", None)


def counted_chunks(monkeypatch) -> list[int]:
    """The chunks each span is cut into from now on (:func:`cuda_pages._chunks`)."""
    counts: list[int] = []
    real = cuda_pages._chunks

    def chunks(start, end):
        made = real(start, end)
        counts.append(len(made))
        return made

    monkeypatch.setattr(cuda_pages, "_chunks", chunks)
    return counts


@pytest.mark.parametrize("family", ["plain", "window"])
def test_a_lossless_restore_copied_through_the_slots_equals_the_cpu_restore(
    tmp_path, copying, monkeypatch, family
):
    config, policy = FAMILIES[family]
    model = model_for(config)
    tokens = prompt(21, 5 * BLOCK + 3)
    before = sys.getswitchinterval()
    with open_store(f"lmdb://{tmp_path / 's'}", block_size=BLOCK) as store:
        store.save("ns", tokens, prefilled(model, tokens, policy))
        match = store.lookup("ns", tokens)
        counts = counted_chunks(monkeypatch)
        restored = store.restore(match, model.make_cache(policy))
        chunks = sum(counts)
        # No page locked: every chunk of every record copied once from a slot into the
        # device memory, which one kernel then gathered every array from; the memory
        # given back when the restore returned.
        assert copying.registrations == 0 and copying.registered == {}
        (copied,) = copying.stagings
        assert copied.copies == chunks > len(counts) > 1 and copied.freed
        assert copying.gathers == 1 and copying.uploads == 0
        assert copying.device_memory == {} and cuda_pages._HELD == []
        monkeypatch.setattr(cuda, "TRANSPORT", False)
        plain = store.restore(match, model.make_cache(policy))
    assert int(restored[0].offset) == int(plain[0].offset) > 4 * BLOCK
    assert_same_caches(restored, plain)
    assert sys.getswitchinterval() == before


@pytest.mark.parametrize("policy", ["kv:quant:8:64", "kv:turboquant:4:4"])
def test_a_lossy_restore_copied_through_the_slots_equals_the_cpu_restore(
    tmp_path, copying, monkeypatch, policy
):
    monkeypatch.setattr(cuda_pages, "COPY_CHUNK_BYTES", PAGE)  # these records are small
    model = model_for("tiny")
    tokens = prompt(22, 3 * BLOCK + 7)
    with open_store(f"lmdb://{tmp_path / 's'}", block_size=BLOCK, storage_policy=policy) as store:
        store.save("ns", tokens, token_by_token(model, tokens))
        match = store.lookup("ns", tokens)
        counts = counted_chunks(monkeypatch)
        on_device = store.restore(match, model.make_cache())
        chunks = sum(counts)
        assert copying.registrations == 0
        assert [s.copies for s in copying.stagings] == [chunks] and chunks > len(counts)
        assert copying.gathers == 1 and copying.uploads == 0
        monkeypatch.setattr(cuda, "TRANSPORT", False)
        plain = store.restore(match, model.make_cache())
    assert int(on_device[0].offset) == len(tokens) - 1
    assert_same_caches(on_device, plain)


def test_a_restore_before_the_slots_are_made_locks_its_pages_and_starts_making_them(
    tmp_path, copying, monkeypatch
):
    # A process's first big restore finds no slots (its warm-up made none): it locks its
    # pages as the ``lock`` route does, and the slots are made behind it, for the next.
    fresh_slots(monkeypatch)
    with plain_prefix(tmp_path, 23) as (store, match, model, policy):
        first = store.restore(match, model.make_cache(policy))
        assert copying.registrations > 0
        cuda_pages.settle()
        assert cuda._SLOTS_READY.wait(10)
        locked = copying.registrations
        again = store.restore(match, model.make_cache(policy))
        assert copying.registrations == locked  # copied this time
        assert_same_caches(first, again)


def test_a_copy_the_driver_refuses_leaves_the_rows_to_the_plain_path_and_nothing_held(
    tmp_path, copying, monkeypatch
):
    with plain_prefix(tmp_path, 23) as (store, match, model, policy):
        copying.refuse = True
        refused = store.restore(match, model.make_cache(policy))
        assert copying.gathers == 0 and copying.uploads > 0  # staged the plain way
        assert all(s.freed for s in copying.stagings) and copying.device_memory == {}
        copying.refuse = False
        monkeypatch.setattr(cuda, "TRANSPORT", False)
        plain = store.restore(match, model.make_cache(policy))
    assert_same_caches(refused, plain)


def test_without_room_for_the_rows_twice_the_pages_are_locked_instead(
    tmp_path, copying, monkeypatch
):
    monkeypatch.setattr(cuda_pages, "_room_for_twice", lambda nbytes: False)
    with plain_prefix(tmp_path, 23) as (store, match, model, policy):
        restored = store.restore(match, model.make_cache(policy))
        assert copying.registrations > 0 and copying.stagings == []
        monkeypatch.setattr(cuda, "TRANSPORT", False)
        plain = store.restore(match, model.make_cache(policy))
    assert_same_caches(restored, plain)


def test_pages_let_go_while_their_copies_run_wait_for_them_and_give_the_memory_back(
    copying, monkeypatch
):
    # A restore that stops early lets its pages go with copies still queued: those not
    # started are called off, the running one finishes (it reads the store's pages,
    # which must stay mapped until then), and only then is the device memory freed.
    monkeypatch.setattr(cuda, "_POOL", KeptPool("test-copies", lambda: 1))  # one at a time
    data = np.random.default_rng(3).integers(0, 256, 16 * PAGE, dtype=np.uint8)
    buffer = mmap.mmap(-1, data.size)
    view = np.frombuffer(buffer, np.uint8)
    view[:] = data
    running, gate = threading.Event(), threading.Event()
    real = cuda_pages._populate

    def held_populate(start, nbytes):
        running.set()
        assert gate.wait(10)
        real(start, nbytes)

    monkeypatch.setattr(cuda_pages, "_populate", held_populate)
    pages = cuda_pages.pin([view])
    assert pages is not None and pages._copy and len(cuda_pages._chunks(*pages.spans[0])) == 8
    assert running.wait(10)  # the first chunk is being copied, the rest wait their turn
    threading.Timer(0.05, gate.set).start()
    pages.release()  # waits for the running one
    assert all(f.done() for f in pages._futures)
    (memory,) = copying.stagings
    assert memory.copies == 1 and memory.freed and copying.device_memory == {}
    assert pages._futures[0].result() is None  # called off: nothing is read from it
    cuda._POOL.forget()
    del view
    buffer.close()


@pytest.mark.parametrize("pages", [1, 2, 3, 7, 8, 9, 64, 65])
@pytest.mark.parametrize("chunk_pages", [1, 2, 5])
def test_a_span_is_cut_into_about_equal_page_aligned_chunks_that_cover_it(
    monkeypatch, pages, chunk_pages
):
    monkeypatch.setattr(cuda_pages, "COPY_CHUNK_BYTES", chunk_pages * PAGE)
    start = 1000 * PAGE
    chunks = cuda_pages._chunks(start, start + pages * PAGE)
    assert len(chunks) == -(-pages // chunk_pages)
    at = start
    for first, nbytes in chunks:  # in order, back to back, whole pages
        assert first == at and first % PAGE == 0 and 0 < nbytes <= chunk_pages * PAGE
        at += nbytes
    assert at == start + pages * PAGE
    sizes = [n for _, n in chunks]
    assert max(sizes) - min(sizes[:-1] or sizes) <= PAGE  # about equal
