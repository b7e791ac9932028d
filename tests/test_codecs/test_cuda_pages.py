"""Arrays gathered by the GPU straight from host pages (kvstore.codecs.cuda_pages), with
the transport swapped for host memory: the segments, registrations and fallbacks run here
as on a GPU, and a restore through them is bit-exact. (The kernel itself is checked on the
device machine: tools/bench/gpu/check.py.)"""

from __future__ import annotations

import mmap
import sys
import threading
import time
from contextlib import contextmanager

import mlx.core as mx
import numpy as np
import pytest

from kvstore.codecs import cuda, cuda_pages, gather_tables, one_buffer
from kvstore.store import open_store
from kvstore.threads import KeptPool
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


@pytest.fixture(params=[True, False], ids=["spans-copied", "host-pages"])
def staged(monkeypatch, request):
    """Each test on both routes: every span copied to the device as it is locked
    (cuda_pages.STAGE_SPANS, the default), and the gathers reading the host pages.
    A call per record locks its pages (these records are small: by default they would
    be joined, which the tests that say so ask for)."""
    transport = HostTransport()
    monkeypatch.setattr(cuda_pages, "STAGE_SPANS", request.param)
    monkeypatch.setattr(cuda_pages, "LOCK_SPANS", "0")
    monkeypatch.setattr(cuda, "TRANSPORT", transport)
    monkeypatch.setattr(cuda_pages, "GATHER_MIN_BYTES", 0)
    monkeypatch.setattr(cuda_pages, "_WORKS", None)
    monkeypatch.setattr(cuda_pages, "_WORKS_FUTURE", None)
    assert cuda_pages._works()  # the once-per-process try, on pages of its own
    cuda_pages.settle()
    transport.gathers = transport.assembles = transport.registrations = 0
    transport.assembled_many.clear()
    assert all(staging.freed for staging in transport.stagings)
    transport.stagings.clear()
    yield transport
    cuda_pages.settle()
    monkeypatch.setattr(cuda, "TRANSPORT", None)


def pieces_of(rng, blocks, batch=1, heads=3, rows=5, dim=8):
    """Row pieces as a restore has them: token ranges of bigger host buffers (strided)."""
    out = []
    for _ in range(blocks):
        buffer = rng.integers(0, 1 << 16, (batch, heads, rows + 4, dim), dtype=np.uint16)
        out.append(buffer.view(np.float16)[:, :, 1 : 1 + rows])
    return out


def kernels(columns, one_buffer=False) -> tuple[int, int]:
    """The gathers and assembles that make one array per column of ``columns``: when the
    spans are copied to the device, a gather per cuda.GATHER_OUTPUTS arrays (``one_buffer``:
    one in all); else when their pages are one span, a gather each (``one_buffer``: one in
    all); else a gather per group of spans, an assemble per array (``one_buffer``: one in
    all)."""
    spans = cuda_pages._spans(
        (int(p.ctypes.data), int(p.ctypes.data) + cuda_pages._extent(p))
        for column in columns
        for p in column
        if p.size
    )
    groups = 1 if cuda_pages.STAGE_SPANS else min(cuda_pages.GATHER_GROUPS, len(spans))
    arrays = 1 if one_buffer else len(columns)
    if cuda_pages.STAGE_SPANS:
        return (-(-arrays // cuda.GATHER_OUTPUTS), 0)
    return (groups, arrays) if groups > 1 else (arrays, 0)


def assert_joined(arrays, columns, specs) -> None:
    """Each array is its column's pieces joined along the rows, zeros past them, bit for bit."""
    for array, pieces, (shape, _) in zip(arrays, columns, specs, strict=True):
        want = np.zeros(shape, np.float16)
        joined = np.concatenate(pieces, axis=2)
        want[:, :, : joined.shape[2]] = joined
        assert np.array_equal(np.array(array).view(np.uint16), want.view(np.uint16))


@pytest.mark.parametrize("groups", [1, 2, 4])
@pytest.mark.parametrize("batch", [1, 2])
def test_a_gather_joins_strided_pieces_and_zeros_to_capacity(staged, monkeypatch, batch, groups):
    monkeypatch.setattr(cuda_pages, "GATHER_GROUPS", groups)  # 1: a gather per array
    rng = np.random.default_rng(0)
    columns = [pieces_of(rng, 3, batch), pieces_of(rng, 2, batch, rows=7)]
    specs = [((batch, 3, 20, 8), "float16"), ((batch, 3, 14, 8), "float16")]
    arrays = cuda_pages.gathered(specs, columns)
    assert arrays is not None and (staged.gathers, staged.assembles) == kernels(columns)
    assert_joined(arrays, columns, specs)
    cuda_pages.settle()
    assert staged.registered == {}  # every page let go once the arrays were made


def test_copied_spans_make_their_arrays_a_kernel_for_each_gather_outputs_of_them(
    staged, monkeypatch
):
    monkeypatch.setattr(cuda, "GATHER_OUTPUTS", 2)  # five arrays: three kernels
    rng = np.random.default_rng(7)
    columns = [pieces_of(rng, 1 + i % 3, rows=3 + i) for i in range(5)]
    specs = [((1, 3, 30, 8), "float16") for _ in columns]
    arrays = cuda_pages.gathered(specs, columns)
    assert arrays is not None and (staged.gathers, staged.assembles) == kernels(columns)
    if cuda_pages.STAGE_SPANS:
        assert staged.gathers == 3
    assert_joined(arrays, columns, specs)


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_one_buffer_makes_every_array_in_one_kernel_or_one_join(staged, monkeypatch, groups):
    monkeypatch.setattr(cuda_pages, "GATHER_GROUPS", groups)  # 1: one gather of every span
    rng = np.random.default_rng(5)
    small = [pieces_of(rng, 3), pieces_of(rng, 2, rows=7, dim=3)]  # 90 bytes a row: unaligned
    maps = [mmap.mmap(-1, mmap.PAGESIZE) for _ in range(5)]  # each piece on a page of its own
    columns, pieces = [], iter(maps)
    for column in small:
        columns.append([])
        for piece in column:
            view = np.frombuffer(next(pieces), np.uint16, piece.size).reshape(piece.shape)
            view[...] = piece.view(np.uint16)
            columns[-1].append(view[:, :, 1:].view(np.float16))  # strided, as a record's
    specs = [((1, 3, 12, 8), "float16"), ((1, 3, 12, 3), "float16")]
    arrays = cuda_pages.gathered(specs, columns, one_buffer=True)
    # Five spans: a group each, up to groups; copied to the device, one gather there.
    want = (groups, 1) if groups > 1 and not cuda_pages.STAGE_SPANS else (1, 0)
    assert arrays is not None and (staged.gathers, staged.assembles) == want
    assert want == kernels(columns, one_buffer=True)
    for array, pieces in zip(arrays, columns, strict=True):
        joined = np.concatenate(pieces, axis=2)
        assert np.array_equal(np.array(array).view(np.uint16), joined.view(np.uint16))


@pytest.mark.parametrize("one_buffer", [True, False])
@pytest.mark.parametrize("batch", [1, 3])
def test_arrays_full_short_empty_or_with_empty_pieces_gather_alike(staged, one_buffer, batch):
    # The segments of every array are built at once (numpy over all pieces): arrays of
    # every kind side by side, each checked byte for byte.
    rng = np.random.default_rng(batch)
    full = pieces_of(rng, 2, batch, rows=4)  # exactly its capacity: no zeros
    gappy = [
        *pieces_of(rng, 1, batch),
        pieces_of(rng, 1, batch, rows=0)[0],
        *pieces_of(rng, 1, batch),
    ]
    nothing = pieces_of(rng, 1, batch, rows=0)  # zeros only
    columns = [full, gappy, nothing, pieces_of(rng, 3, batch, rows=2, dim=3)]
    specs = [
        ((batch, 3, 8, 8), "float16"),
        ((batch, 3, 13, 8), "float16"),
        ((batch, 3, 6, 8), "float16"),
        ((batch, 3, 9, 3), "float16"),
    ]
    arrays = cuda_pages.gathered(specs, columns, one_buffer=one_buffer)
    want = kernels(columns, one_buffer)
    assert arrays is not None and (staged.gathers, staged.assembles) == want
    assert_joined(arrays, columns, specs)


def test_unaligned_rows_are_copied_byte_by_byte(staged):
    rng = np.random.default_rng(1)
    pieces = [rng.integers(0, 255, (1, 2, 3, 3), dtype=np.uint8) for _ in range(2)]
    (array,) = cuda_pages.gathered([((1, 2, 7, 3), "uint8")], [pieces])
    want = np.zeros((1, 2, 7, 3), np.uint8)
    want[:, :, :6] = np.concatenate(pieces, axis=2)
    assert np.array_equal(np.array(array), want)


@pytest.mark.parametrize(
    "piece, shape, why",
    [
        (np.zeros((1, 2, 4, 8), np.float32), ((1, 2, 8, 8), "float16"), "another dtype"),
        (np.zeros((1, 3, 4, 8), np.float16), ((1, 2, 8, 8), "float16"), "other heads"),
        (np.zeros((1, 2, 4, 16), np.float16)[..., ::2], ((1, 2, 8, 8), "float16"), "strided rows"),
        (np.zeros((1, 2, 9, 8), np.float16), ((1, 2, 8, 8), "float16"), "past capacity"),
    ],
)
def test_pieces_a_gather_cannot_read_are_left_to_staging(staged, piece, shape, why):
    assert cuda_pages.gathered([shape], [[piece]]) is None, why
    assert staged.gathers == 0 and staged.registered == {}


def test_pages_another_gather_holds_are_not_registered_twice(staged):
    rng = np.random.default_rng(2)
    pieces = pieces_of(rng, 2)
    spec = ((1, 3, 10, 8), "float16")
    held = cuda_pages._spans((int(p.ctypes.data), int(p.ctypes.data) + p.nbytes) for p in pieces)
    cuda_pages._HELD.extend(held)  # as if another thread's gather were running
    try:
        assert cuda_pages.gathered([spec], [pieces]) is None
    finally:
        del cuda_pages._HELD[:]
    assert staged.gathers == 0 and staged.registered == {}


def test_a_gather_that_returns_wrong_bytes_turns_the_route_off(staged, monkeypatch):
    real, real_many = staged.gather, staged.gather_many
    monkeypatch.setattr(staged, "gather", lambda params, n: real(params, n) + 1)
    monkeypatch.setattr(
        staged, "gather_many", lambda params, n: [a + 1 for a in real_many(params, n)]
    )
    monkeypatch.setattr(cuda_pages, "_WORKS", None)
    monkeypatch.setattr(cuda_pages, "_WORKS_FUTURE", None)
    pieces = pieces_of(np.random.default_rng(4), 2)
    spec = ((1, 3, 10, 8), "float16")
    # The first call starts the try in the background and does not wait for it.
    assert cuda_pages.gathered([spec], [pieces]) is None
    assert cuda_pages._WORKS_FUTURE.result() is False
    assert cuda_pages.gathered([spec], [pieces]) is None
    # The try's one gather from the copied spans (its first route: it stops there), or
    # its two groups of pages; then no more.
    assert cuda_pages._WORKS is False and staged.gathers == (1 if cuda_pages.STAGE_SPANS else 2)
    cuda_pages.settle()
    assert staged.registered == {} and staged.device_memory == {}


def test_an_assemble_that_returns_wrong_bytes_turns_the_route_off(staged, monkeypatch):
    real = staged.assemble
    monkeypatch.setattr(staged, "assemble", lambda params, b, n: real(params, b, n) + 1)
    monkeypatch.setattr(cuda_pages, "_WORKS", None)
    monkeypatch.setattr(cuda_pages, "_WORKS_FUTURE", None)
    assert cuda_pages._works() is False  # the try joins two groups of pages, as a restore
    pieces = pieces_of(np.random.default_rng(4), 2)
    assert cuda_pages.gathered([((1, 3, 10, 8), "float16")], [pieces]) is None
    cuda_pages.settle()
    assert staged.registered == {}


def test_rows_in_many_spans_cross_a_group_at_a_time_before_the_last_pages_are_locked(
    staged, monkeypatch
):
    """Every array has rows in every record (a block each), so a gather per array would
    wait for the last record's pages. The rows go instead a group of spans at a time
    into buffers of their own, the first launched while the last span is still being
    locked, and one kernel per array joins them, zeros past the rows: bit-exact. Or,
    the spans copied to the device, each span is copied as soon as it is locked, the
    last one's pages still waiting, and a gather per array reads them there after."""
    page = cuda_pages._PAGE
    rng = np.random.default_rng(11)
    maps = [mmap.mmap(-1, 2 * page) for _ in range(10)]  # ten records, ten spans
    records = [np.frombuffer(m, np.float16, 2 * 3 * 40 * 8).reshape(2, 3, 40, 8) for m in maps]
    records.sort(key=lambda r: int(r.ctypes.data))  # spans are locked in address order
    for record in records:
        record[...] = rng.standard_normal(record.shape)
    columns = [[r[:, :, :5] for r in records], [r[:, :, 9:16] for r in records]]  # 2 arrays
    specs = [((2, 3, 53, 8), "float16"), ((2, 3, 70, 8), "float16")]  # zeros past the first
    last = int(records[-1].ctypes.data) // page * page
    gate = threading.Event()
    real = staged.register

    def register(base: int, nbytes: int) -> int:
        if base == last:
            assert gate.wait(10)  # the last record's pages wait
        return real(base, nbytes)

    monkeypatch.setattr(staged, "register", register)
    result: list = []
    worker = threading.Thread(target=lambda: result.append(cuda_pages.gathered(specs, columns)))
    assert sum(p.shape[2] for p in columns[0]) < specs[0][0][2]
    worker.start()
    deadline = time.monotonic() + 10
    groups = cuda_pages.GATHER_GROUPS
    assert 1 < groups < len(records)  # some groups of two spans
    copied = cuda_pages.STAGE_SPANS

    def early() -> int:  # what has crossed while the last pages wait
        return staged.stagings[0].copies if copied and staged.stagings else staged.gathers

    while early() < (len(records) if copied else groups) - 1 and time.monotonic() < deadline:
        worker.join(0.01)
    crossed_early, launched_early = early(), staged.gathers
    gate.set()
    worker.join(10)
    assert not worker.is_alive()
    if copied:  # every span but the last one's copied; no gather before they all are
        assert (crossed_early, launched_early) == (len(records) - 1, 0)
        assert (staged.gathers, staged.assembles) == (1, 0) == kernels(columns)
    else:
        assert launched_early == groups - 1  # every group but the last one's
        assert (staged.gathers, staged.assembles) == (groups, 2) == kernels(columns)
    (arrays,) = result
    assert_joined(arrays, columns, specs)
    cuda_pages.settle()
    assert staged.registered == {}


def test_a_refused_registration_leaves_nothing_registered(staged):
    staged.refuse = True
    pieces = pieces_of(np.random.default_rng(3), 2)
    assert cuda_pages.gathered([((1, 3, 10, 8), "float16")], [pieces]) is None
    cuda_pages.settle()  # the pages are let go on a staging thread
    assert staged.registered == {} and cuda_pages._HELD == []


@pytest.mark.parametrize(
    "lock_spans", ["0", "2", ""], ids=["call-per-record", "joined-calls", "default-small-records"]
)
@pytest.mark.parametrize("family", ["plain", "window"])
def test_a_lossless_restore_gathers_from_the_store_pages_and_equals_the_cpu_restore(
    tmp_path, staged, monkeypatch, family, lock_spans
):
    monkeypatch.setattr(cuda_pages, "LOCK_SPANS", lock_spans)
    config, policy = FAMILIES[family]
    model = model_for(config)
    tokens = prompt(6, 5 * BLOCK + 3)
    real, real_many = staged.gather, staged.gather_many
    locked_at_gathers: list[int] = []

    def gather(params, nbytes):
        locked_at_gathers.append(len(staged.registered))
        return real(params, nbytes)

    def gather_many(params, nbytes):
        locked_at_gathers.append(len(staged.registered))
        return real_many(params, nbytes)

    monkeypatch.setattr(staged, "gather", gather)
    monkeypatch.setattr(staged, "gather_many", gather_many)
    with open_store(f"lmdb://{tmp_path / 's'}", block_size=BLOCK) as store:
        store.save("ns", tokens, prefilled(model, tokens, policy))
        match = store.lookup("ns", tokens)
        cuda_pages.trial_done()
        before = staged.registrations
        restored = store.restore(match, model.make_cache(policy))
        calls = staged.registrations - before
        # Every array read by the GPU from the store's pages, still locked while the
        # gathers ran: no slot staged. (From the spans copied to the device, one kernel
        # for every array; from the pages, a kernel per array, or, the records' pages in
        # several spans, a gather per group of them and an assemble per array.)
        arrays = 2 * len(restored)
        assert staged.uploads == 0
        if cuda_pages.STAGE_SPANS:
            assert arrays <= cuda.GATHER_OUTPUTS and (staged.gathers, staged.assembles) == (1, 0)
        else:
            assert (staged.gathers, staged.assembles) == (arrays, 0) or (
                1 < staged.gathers <= cuda.ASSEMBLE_INPUTS and staged.assembles == arrays
            )
        assert min(locked_at_gathers) > 0
        # A call per record, or fewer: touching records' pages joined (LMDB leaves a few
        # pages between some of them, which are never locked).
        if lock_spans != "0":  # the default joins these small records too
            assert 1 <= calls < len(match.blocks)
        else:
            assert calls == len(match.blocks)
        if cuda_pages.STAGE_SPANS:  # each record's span copied once, the memory given back
            (copied,) = staged.stagings
            assert copied.copies == staged.registrations and copied.freed
        cuda_pages.settle()
        assert staged.registered == {} and staged.device_memory == {}
        monkeypatch.setattr(cuda, "TRANSPORT", False)
        plain = store.restore(match, model.make_cache(policy))
    assert int(restored[0].offset) == int(plain[0].offset) > 4 * BLOCK
    assert_same_caches(restored, plain)
    for cache in restored:  # each cache owns its buffers (an update copies nothing else)
        assert isinstance(cache.keys, mx.array)


def test_a_restore_on_the_gpu_path_never_serves_rows_of_a_record_that_fails_its_checksum(
    tmp_path, staged
):
    from kvstore.abc.store import MissReason
    from kvstore.store import open_backend

    model = model_for("tiny")
    tokens = prompt(7, 4 * BLOCK + 3)
    url = f"lmdb://{tmp_path / 's'}"
    with open_store(url, block_size=BLOCK, touch_interval=0) as store:
        store.save("ns", tokens, prefilled(model, tokens))
        blocks = store.lookup("ns", tokens).blocks
    backend = open_backend(url)
    try:  # the last payload byte of the third block flipped, its header intact
        value = bytearray(backend.get_many([blocks[2].key])[0])
        value[-1] ^= 0x10
        backend.put_many([(blocks[2].key, bytes(value))])
    finally:
        backend.close()
    with open_store(url, block_size=BLOCK, touch_interval=0) as store:
        restored = store.restore(store.lookup("ns", tokens), model.make_cache())
        assert store.activity()["misses"][MissReason.CORRUPT] == 1
    assert staged.gathers > 0  # the rows were gathered before the checks had all passed
    assert int(restored[0].offset) == blocks[2].start == 2 * BLOCK
    assert_same_caches(restored, prefilled(model, tokens[: 2 * BLOCK]))


@pytest.mark.parametrize("stacked_decode", ["stacked", "per-layer", "one-layer-stacks"])
@pytest.mark.parametrize("policy", ["kv:quant:8:64", "kv:turboquant:4:4"])
def test_a_lossy_restore_gathers_each_tensors_joined_rows_from_the_pinned_pages(
    tmp_path, staged, monkeypatch, policy, stacked_decode
):
    from kvstore.store.kv import restore as restore_module

    monkeypatch.setenv("KVSTORE_STACKED_DECODE", "0" if stacked_decode == "per-layer" else "1")
    if stacked_decode == "one-layer-stacks":  # fewer vectors than any layer's: a stack each
        monkeypatch.setattr(restore_module, "STACKED_DECODE_VECTORS", 1)

    model = model_for("tiny")
    tokens = prompt(8, 3 * BLOCK + 7)
    url = f"lmdb://{tmp_path / 's'}"
    viewed = []
    real_layout = gather_tables.host_layout

    def layout(pieces, shape, name):
        viewed.append(len(pieces))
        return real_layout(pieces, shape, name)

    monkeypatch.setattr(gather_tables, "host_layout", layout)
    stacks, given = [], []

    def stacked(snapshots, to_signature, views=None, decoded=None):
        stacks.append(restore_module_stacked(snapshots, to_signature, views, decoded))
        if stacks[-1] is not None:  # the names stacked as views, and those that can be
            tensors = snapshots[0].tensors
            aligned = {n for n, a in tensors.items() if a.nbytes % 16 == 0}
            given.append((sorted(views or {}), sorted(aligned)))
        return stacks[-1]

    restore_module_stacked = restore_module.transcode_stacked
    monkeypatch.setattr(restore_module, "transcode_stacked", stacked)
    with open_store(url, block_size=BLOCK, storage_policy=policy) as store:
        store.save("ns", tokens, token_by_token(model, tokens))
        match = store.lookup("ns", tokens)
        on_device = store.restore(match, model.make_cache())
        # Every layer decoded in one conversion, stacked (per kind of stored signature);
        # or, switched off, one by one.
        want = [len(on_device)] if stacked_decode == "stacked" else []
        assert [len(s) for s in stacks if s is not None] == want
        # ...each tensor's joins of every layer already stacked, one after another in
        # the gather's output: a view of it, no concatenation (but where padding to
        # 16-byte words lies between them).
        assert len(given) == len(want) and all(views == aligned for views, aligned in given)
        if policy == "kv:quant:8:64":  # every q8 tensor's joins are whole 16-byte words
            assert all(views for views, _ in given)
        # Every stored row tensor of every layer (its rows of every record joined) is
        # made in one buffer: a gather per group of the records' spans, as they are
        # locked, then one assemble (or, the spans copied to the device as they are
        # locked, one gather there); each is decoded on the device; nothing staged.
        spans = staged.registrations  # one per span (the restore's first)
        groups = 1 if cuda_pages.STAGE_SPANS else min(cuda_pages.GATHER_GROUPS, spans)
        assert spans == 4 and (staged.gathers, staged.assembles) == (groups, int(groups > 1))
        assert [s.copies for s in staged.stagings] == ([4] if cuda_pages.STAGE_SPANS else [])
        assert staged.uploads == 0
        # ...read where the headers say they lie, the last block's cut included: no
        # piece was viewed to find its address.
        assert viewed == []
        # The decoded rows of every layer written into each cache's own arrays by one
        # kernel per 64 arrays and 8 decoded stacks (a stack of keys and one of values
        # per layer: four layers to a kernel); decoded one by one, joined one by one.
        layers = len(on_device)
        kernels = {"stacked": [2 * layers], "one-layer-stacks": [8] * (layers // 4)}
        assert staged.assembled_many == kernels.get(stacked_decode, [])
        monkeypatch.setattr(cuda, "TRANSPORT", False)
        plain = store.restore(match, model.make_cache())
    assert int(on_device[0].offset) == len(tokens) - 1
    assert_same_caches(on_device, plain)


def test_described_lossy_rows_no_gather_reads_are_filled_from_their_views(
    tmp_path, staged, monkeypatch
):
    """Pages pinned, but no gather taken (the process's try not passed yet): the rows the
    headers describe are joined from views on the host instead, bit-exact."""
    model = model_for("tiny")
    tokens = prompt(9, 3 * BLOCK + 5)
    url = f"lmdb://{tmp_path / 's'}"
    with open_store(url, block_size=BLOCK, storage_policy="kv:quant:8:64") as store:
        store.save("ns", tokens, token_by_token(model, tokens))
        match = store.lookup("ns", tokens)
        monkeypatch.setattr(cuda_pages, "proven", lambda: False)
        pinned = []
        real_pin = cuda_pages.pin

        def pin(buffers):
            pinned.append(real_pin(buffers))
            return pinned[-1]

        monkeypatch.setattr(cuda_pages, "pin", pin)
        filled = store.restore(match, model.make_cache())
        assert len(pinned) == 1 and pinned[0] is not None  # the layers were described
        assert staged.gathers == 0  # ...and none gathered
        monkeypatch.setattr(cuda, "TRANSPORT", False)
        plain = store.restore(match, model.make_cache())
    assert int(filled[0].offset) == len(tokens) - 1
    assert_same_caches(filled, plain)


def test_ranges_sharing_a_page_are_one_span_and_touching_ones_stay_apart(monkeypatch):
    monkeypatch.setattr(cuda_pages, "LOCK_SPANS", "0")  # a call per record, as asked
    page = cuda_pages._PAGE
    spans = cuda_pages._spans(
        [(3 * page + 10, 5 * page), (5 * page, 6 * page - 1), (page, page + 5)]
    )
    assert spans == [(page, 2 * page), (3 * page, 5 * page), (5 * page, 6 * page)]
    assert cuda_pages._spans([(0, page + 1), (page + 7, 3 * page)]) == [(0, 3 * page)]


def test_touching_spans_join_into_about_as_many_calls_as_asked_and_gaps_stay_apart():
    page = cuda_pages._PAGE
    touching = [(i * page, (i + 1) * page) for i in range(8)]
    assert cuda_pages._joined_spans(touching, 2) == [(0, 4 * page), (4 * page, 8 * page)]
    assert cuda_pages._joined_spans(touching, 1) == [(0, 8 * page)]
    assert cuda_pages._joined_spans(touching, 8) == touching
    gapped = [*touching[:3], (10 * page, 11 * page)]  # a gap is never locked
    assert cuda_pages._joined_spans(gapped, 1) == [(0, 3 * page), (10 * page, 11 * page)]
    uneven = [(0, 9 * page), (9 * page, 18 * page), (18 * page, 19 * page)]
    assert cuda_pages._joined_spans(uneven, 2) == [(0, 9 * page), (9 * page, 19 * page)]


def test_the_lock_calls_are_one_per_record_a_number_asked_or_as_many_as_cost_least(
    monkeypatch,
):
    def spans(mib: int) -> list[tuple[int, int]]:  # two records of mib / 2 each
        half = mib << 19
        return [(0, half), (half, 2 * half)]

    def records(count: int, mib: float) -> list[tuple[int, int]]:
        size = int(mib * (1 << 20))
        return [(i * size, (i + 1) * size) for i in range(count)]

    monkeypatch.setattr(cuda_pages, "LOCK_SPANS", "0")
    assert cuda_pages._lock_calls(records(16, 8)) == 0  # a call per record
    # Unset: a call per record of a lossless llama-8B restore (16 of 32 MiB), auto's
    # calls for small ones (q8's 17 MiB, TurboQuant 4/4's 8.3 MiB), as measured.
    monkeypatch.setattr(cuda_pages, "LOCK_SPANS", "")
    assert cuda_pages._lock_calls(records(16, 32)) == 0
    assert cuda_pages._lock_calls(records(16, 17)) == 4
    assert cuda_pages._lock_calls(records(16, 8.3)) == 2
    assert cuda_pages._lock_calls([]) == 0
    monkeypatch.setattr(cuda_pages, "LOCK_SPANS", "3")
    assert cuda_pages._lock_calls(spans(512)) == 3
    monkeypatch.setattr(cuda_pages, "LOCK_SPANS", "auto")
    # More bytes, more calls: each call's own cost against the last span's copy.
    assert [cuda_pages._lock_calls(spans(mib)) for mib in (1, 133, 512, 2048)] == [1, 2, 5, 10]


def test_a_gather_starts_before_later_records_are_locked_and_the_gil_is_handed_on_sooner(
    staged, monkeypatch
):
    """Array i's kernel is launched once the pages holding its rows are locked (a lossy
    restore gathers each record's payload as soon as that record is locked), or, the
    spans copied to the device, the first record is copied while the second waits; and
    while registrations run the GIL switch interval is short, then back as it was."""
    page = cuda_pages._PAGE
    rng = np.random.default_rng(9)
    maps = [mmap.mmap(-1, 4 * page) for _ in range(2)]  # records on pages of their own
    records = [np.frombuffer(m, np.uint8, 3 * page, offset=64).reshape(1, 1, -1, 1) for m in maps]
    records.sort(key=lambda r: int(r.ctypes.data))  # spans are locked in address order
    for record in records:
        record[...] = rng.integers(0, 256, record.shape, dtype=np.uint8)
    specs = [(r.shape, "uint8") for r in records]
    second = int(records[1].ctypes.data) // page * page
    gate = threading.Event()
    real = staged.register
    during: list[float] = []

    def register(base: int, nbytes: int) -> int:
        if base == second:
            during.append(sys.getswitchinterval())
            assert gate.wait(10)  # the second record's pages wait
        return real(base, nbytes)

    monkeypatch.setattr(staged, "register", register)
    before = sys.getswitchinterval()
    result: list = []
    worker = threading.Thread(
        target=lambda: result.append(cuda_pages.gathered(specs, [[r] for r in records]))
    )
    worker.start()
    copied = cuda_pages.STAGE_SPANS

    def early() -> int:  # what has crossed while the second record's pages wait
        return staged.stagings[0].copies if copied and staged.stagings else staged.gathers

    deadline = time.monotonic() + 10
    while early() < 1 and time.monotonic() < deadline:
        worker.join(0.01)
    crossed_early, launched_early = early(), staged.gathers
    gate.set()
    worker.join(10)
    assert crossed_early == 1 and not worker.is_alive()
    assert launched_early == (0 if copied else 1)
    (arrays,) = result
    assert arrays is not None
    for array, record in zip(arrays, records, strict=True):
        assert np.array_equal(np.array(array), record)
    assert during == [cuda_pages.SWITCH_SECONDS]
    assert sys.getswitchinterval() == before


def test_a_first_small_restore_starts_the_try_of_a_gather(staged, monkeypatch):
    monkeypatch.setattr(cuda_pages, "_WORKS", None)
    monkeypatch.setattr(cuda_pages, "_WORKS_FUTURE", None)
    monkeypatch.setattr(cuda_pages, "GATHER_MIN_BYTES", 1 << 30)
    assert cuda_pages.pin([bytes(100)]) is None  # too small to pin
    assert cuda_pages._WORKS_FUTURE is not None and cuda_pages._WORKS_FUTURE.result() is True


def test_a_warm_up_waits_for_the_trial_it_started_and_then_gathers(staged, monkeypatch):
    monkeypatch.setattr(cuda_pages, "_WORKS", None)
    monkeypatch.setattr(cuda_pages, "_WORKS_FUTURE", None)
    assert cuda_pages.trial_done() is False  # none started: nothing to wait for
    gate = threading.Event()
    real = cuda_pages._try_a_gather

    def slow_try():
        assert gate.wait(10)
        return real()

    monkeypatch.setattr(cuda_pages, "_try_a_gather", slow_try)
    columns = [pieces_of(np.random.default_rng(16), 2)]
    specs = [((1, 3, 10, 8), "float16")]
    assert cuda_pages.gathered(specs, columns) is None  # starts the trial, does not wait
    threading.Timer(0.05, gate.set).start()
    assert cuda_pages.trial_done() is True  # waits for it
    arrays = cuda_pages.gathered(specs, columns)
    assert arrays is not None
    assert_joined(arrays, columns, specs)


@pytest.mark.parametrize("delay", [0.0, 0.01, 60.0])
def test_concurrent_restores_of_one_prefix_are_each_bit_exact_and_let_everything_go(
    tmp_path, staged, monkeypatch, delay
):
    """Threads restoring the same prefix at once: each gathers (or, where another holds
    the pages, stages) the same caches; afterwards nothing is registered or held and
    the GIL switch interval is what it was. Pages are let go at once, by timers racing
    the restores, or only when a later restore needs them."""
    monkeypatch.setattr(cuda_pages, "RELEASE_DELAY_SECONDS", delay)
    model = model_for("tiny")
    tokens = prompt(10, 5 * BLOCK + 3)
    before = sys.getswitchinterval()
    with open_store(f"lmdb://{tmp_path / 's'}", block_size=BLOCK) as store:
        store.save("ns", tokens, prefilled(model, tokens))
        match = store.lookup("ns", tokens)
        want = store.restore(match, model.make_cache())
        errors: list[BaseException] = []

        def restore_a_few() -> None:
            try:
                for _ in range(6):
                    assert_same_caches(store.restore(match, model.make_cache()), want)
            except BaseException as exc:  # noqa: BLE001 - reported by the test thread
                errors.append(exc)

        workers = [threading.Thread(target=restore_a_few) for _ in range(4)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(60)
    cuda_pages.settle()
    assert not errors and not any(w.is_alive() for w in workers)
    assert staged.gathers > 0
    assert staged.registered == {} and cuda_pages._HELD == []
    assert sys.getswitchinterval() == before


@contextmanager
def plain_prefix(tmp_path, seed: int):
    """A store holding a plain prefix of 3 blocks and a token: ``(store, match, model,
    policy)``."""
    config, policy = FAMILIES["plain"]
    model = model_for(config)
    tokens = prompt(seed, 3 * BLOCK + 1)
    with open_store(f"lmdb://{tmp_path / 's'}", block_size=BLOCK) as store:
        store.save("ns", tokens, prefilled(model, tokens, policy))
        yield store, store.lookup("ns", tokens), model, policy


def test_a_restores_pages_are_let_go_after_the_delay_or_at_once_when_needed(
    tmp_path, staged, monkeypatch
):
    # Unregistering pinned pages stalls kernels launched meanwhile (the first token's
    # forward on the H200): a restore's pages stay locked for RELEASE_DELAY_SECONDS after
    # it returns. A restore of the same pages before then lets them go first, and reads
    # the same rows; settle() lets them go at once; the delay lets them go unasked.
    monkeypatch.setattr(cuda_pages, "RELEASE_DELAY_SECONDS", 1.0)
    with plain_prefix(tmp_path, 7) as (store, match, model, policy):
        first = store.restore(match, model.make_cache(policy))
        assert staged.registered  # still locked after the restore returned
        gathers = staged.gathers
        again = store.restore(match, model.make_cache(policy))  # the same pages, at once
        assert staged.gathers == 2 * gathers and staged.uploads == 0
        assert_same_caches(first, again)
        cuda_pages.settle()
        assert staged.registered == {} and cuda_pages._HELD == []
        store.restore(match, model.make_cache(policy))
        assert staged.registered
        deadline = time.monotonic() + 10
        while staged.registered and time.monotonic() < deadline:
            time.sleep(0.05)
        assert staged.registered == {} and cuda_pages._HELD == []  # let go by the timer


def test_a_restore_of_pages_waiting_for_release_does_not_wait_for_it_on_its_thread(
    tmp_path, staged, monkeypatch
):
    # A session's warm-up restores a prefix's first block and its first real restore the
    # whole prefix right after, while the warm-up's pages wait for their delayed release.
    # That release now starts at once on a staging thread, the shared pages are locked
    # after it, and the restore's own thread goes on meanwhile: here, the unregistration
    # waits for the restore's thread to reach its header parse (with a settle on that
    # thread, as before, it would wait in vain). Bit-exact, and everything let go after.
    from kvstore.store.kv import restore as restore_module

    monkeypatch.setattr(cuda_pages, "RELEASE_DELAY_SECONDS", 60.0)
    parsing = threading.Event()
    saw_parsing: list[bool] = []
    real_unregister, real_headers = staged.unregister, restore_module._headers

    def unregister(base: int) -> None:
        saw_parsing.append(parsing.wait(10))
        real_unregister(base)

    def headers(*args, **kwargs):
        parsing.set()
        return real_headers(*args, **kwargs)

    with plain_prefix(tmp_path, 8) as (store, match, model, policy):
        first = store.restore(match, model.make_cache(policy))
        assert staged.registered  # waiting for their release
        monkeypatch.setattr(staged, "unregister", unregister)
        monkeypatch.setattr(restore_module, "_headers", headers)
        gathers = staged.gathers
        again = store.restore(match, model.make_cache(policy))
        assert saw_parsing and all(saw_parsing)  # let go while the restore went on
        assert staged.gathers == 2 * gathers and staged.uploads == 0  # no staging
        assert_same_caches(first, again)
        cuda_pages.settle()
        assert staged.registered == {} and cuda_pages._HELD == []


def test_pages_are_locked_on_threads_of_their_own_as_many_as_the_environment_says(monkeypatch):
    monkeypatch.setattr(cuda_pages, "_REGISTER_POOL", KeptPool("test-register", lambda: 0))
    pool = cuda_pages._REGISTER_POOL
    monkeypatch.setattr(pool, "_workers", cuda_pages.register_threads)
    monkeypatch.delenv("KVSTORE_CUDA_REGISTER_THREADS", raising=False)
    made = cuda_pages._register_pool()
    assert cuda_pages._register_pool() is made  # kept for the process
    assert made._max_workers == cuda_pages.REGISTER_THREADS_DEFAULT
    assert len(made._threads) == made._max_workers  # all started when made
    pool.forget()
    monkeypatch.setenv("KVSTORE_CUDA_REGISTER_THREADS", "3")
    assert cuda_pages._register_pool()._max_workers == 3
    pool.forget()
    monkeypatch.setenv("KVSTORE_CUDA_REGISTER_THREADS", "0")
    with pytest.raises(ValueError, match="KVSTORE_CUDA_REGISTER_THREADS"):
        cuda_pages._register_pool()


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        ("KVSTORE_CUDA_GATHER_GROUPS", "0", "expected a positive number of groups"),
        ("KVSTORE_CUDA_LOCK_SPANS", "few", "expected a number of calls or 'auto'"),
    ],
)
def test_a_setting_the_route_cannot_use_is_refused_by_name(variable, value, message):
    import os
    import subprocess

    done = subprocess.run(
        [sys.executable, "-c", "import kvstore.codecs.cuda_pages"],
        capture_output=True,
        text=True,
        env={**os.environ, variable: value},
    )
    assert done.returncode != 0
    assert f"{variable}={value!r}: {message}" in done.stderr


def test_without_room_for_the_rows_twice_each_array_is_gathered_alone(staged, monkeypatch):
    # The group buffers (or the spans' copies) and the arrays made from them are on the
    # device at once; near MLX's memory limit each array is gathered from the pages
    # instead, bit-exact, and no device memory is taken for copies.
    rng = np.random.default_rng(12)
    columns = [pieces_of(rng, 3), pieces_of(rng, 2, rows=7)]
    specs = [((1, 3, 20, 8), "float16"), ((1, 3, 14, 8), "float16")]
    assert cuda_pages.STAGE_SPANS or kernels(columns)[1] == 2  # groups, were there room
    need = 2 * sum(cuda.nbytes_of(spec) for spec in specs)
    monkeypatch.setattr(cuda_pages.mx, "get_active_memory", lambda: 1000)
    monkeypatch.setattr(cuda_pages.mx, "get_memory_limit", lambda: 1000 + need - 1)
    arrays = cuda_pages.gathered(specs, columns)
    assert arrays is not None and (staged.gathers, staged.assembles) == (2, 0)
    assert staged.stagings == []
    assert_joined(arrays, columns, specs)


def test_spans_copied_only_where_the_device_gives_memory_for_them(staged, monkeypatch):
    # A device that refuses the memory for the copies: the rows cross from the pages as
    # before (in groups), bit-exact.
    monkeypatch.setattr(cuda_pages, "STAGE_SPANS", True)
    staged.no_staging = True
    rng = np.random.default_rng(13)
    columns = [pieces_of(rng, 3), pieces_of(rng, 2, rows=7)]
    specs = [((1, 3, 20, 8), "float16"), ((1, 3, 14, 8), "float16")]
    arrays = cuda_pages.gathered(specs, columns)
    assert arrays is not None and staged.stagings == []
    groups = min(cuda_pages.GATHER_GROUPS, staged.registrations)
    assert groups > 1 and (staged.gathers, staged.assembles) == (groups, 2)
    assert_joined(arrays, columns, specs)


def test_a_copy_the_driver_refuses_leaves_the_rows_to_staging_and_nothing_held(staged, monkeypatch):
    # No gather reads memory a copy did not fill: the gather is not made (the caller
    # stages the plain way), the pages are let go and the device memory given back.
    monkeypatch.setattr(cuda_pages, "STAGE_SPANS", True)
    real = staged.staging

    def staging(nbytes):
        made = real(nbytes)

        def refused(offset, host, nbytes):
            raise RuntimeError("[cuda] cuMemcpyHtoDAsync failed with CUresult 1.")

        made.copy = refused
        return made

    monkeypatch.setattr(staged, "staging", staging)
    rng = np.random.default_rng(14)
    columns = [pieces_of(rng, 3), pieces_of(rng, 2, rows=7)]
    specs = [((1, 3, 20, 8), "float16"), ((1, 3, 14, 8), "float16")]
    assert cuda_pages.gathered(specs, columns) is None
    assert staged.gathers == 0
    (refused_copies,) = staged.stagings
    assert refused_copies.freed
    cuda_pages.settle()
    assert staged.registered == {} and staged.device_memory == {}


def test_the_pages_start_being_locked_before_the_device_memory_for_their_copies_is_taken(
    staged, monkeypatch
):
    # Taking the device memory took 1.3 ms on the H200, the first registration waiting
    # behind it; now it waits for nothing (and the copies wait for the memory). It is
    # taken off the caller's thread too (behind the driver's first registrations it
    # held a restore's own thread for up to 6 ms).
    monkeypatch.setattr(cuda_pages, "STAGE_SPANS", True)
    locking = threading.Event()
    real_register, real_staging = staged.register, staged.staging
    takers = []

    def register(base, nbytes):
        locking.set()
        return real_register(base, nbytes)

    def staging(nbytes):
        takers.append(threading.get_ident())
        assert locking.wait(10), "no registration started before the memory was taken"
        return real_staging(nbytes)

    monkeypatch.setattr(staged, "register", register)
    monkeypatch.setattr(staged, "staging", staging)
    rng = np.random.default_rng(15)
    columns = [pieces_of(rng, 3)]
    arrays = cuda_pages.gathered([((1, 3, 20, 8), "float16")], columns)
    assert arrays is not None and staged.stagings[0].copies == staged.registrations > 0
    assert takers and threading.get_ident() not in takers
    want = np.zeros((1, 3, 20, 8), np.float16)
    want[:, :, :15] = np.concatenate(columns[0], axis=2)
    assert np.array_equal(np.array(arrays[0]).view(np.uint16), want.view(np.uint16))


def test_pages_let_go_before_their_locking_ends_give_the_copies_memory_back_after_it(
    staged, monkeypatch
):
    # A restore that stops before it gathers (its first record unreadable, say) does
    # not wait for the registrations still running; the device memory goes back when
    # the last of them is done, after its copy was queued, not before.
    monkeypatch.setattr(cuda_pages, "STAGE_SPANS", True)
    gate = threading.Event()
    real = staged.register

    def register(base, nbytes):
        assert gate.wait(10)
        return real(base, nbytes)

    monkeypatch.setattr(staged, "register", register)
    maps = [mmap.mmap(-1, 2 * mmap.PAGESIZE) for _ in range(3)]
    pages = cuda_pages.pin(maps)
    assert pages is not None and pages.staged
    pages.release()  # returns while every registration waits
    (copies,) = staged.stagings
    assert not copies.freed and copies.copies == 0
    gate.set()
    deadline = time.monotonic() + 10
    while not copies.freed and time.monotonic() < deadline:
        time.sleep(0.01)
    assert copies.freed and copies.copies == len(pages.spans)
    cuda_pages.settle()
    assert staged.registered == {} and staged.device_memory == {}


@pytest.mark.parametrize("pinned", [True, False])
def test_a_lazy_gather_from_pages_pinned_already_leaves_the_evaluation_to_its_caller(
    staged, monkeypatch, pinned
):
    # A lossy restore evaluates its gather with the decode of what it gathered: one
    # evaluation. Pages the gather pins itself are let go after it, so it evaluates then.
    maps = [mmap.mmap(-1, 2 * mmap.PAGESIZE) for _ in range(2)]
    column = [np.frombuffer(m, np.uint16, 3 * 40).reshape(1, 3, 1, 40) for m in maps]
    for i, piece in enumerate(column):
        piece[...] = np.arange(120, dtype=np.uint16).reshape(piece.shape) + i
    specs = [((1, 3, 2, 40), "uint16")]
    pages = cuda_pages.pin(maps) if pinned else None
    evaluations: list[int] = []
    real_eval = mx.eval
    monkeypatch.setattr(mx, "eval", lambda *a: evaluations.append(1) or real_eval(*a))
    arrays = cuda_pages.gathered(specs, [column], pages, one_buffer=True, lazy=True)
    monkeypatch.setattr(mx, "eval", real_eval)
    assert arrays is not None and len(evaluations) == (0 if pinned else 1)
    assert np.array_equal(np.array(arrays[0]), np.concatenate(column, axis=2))
    if pages is not None:
        pages.release()
    cuda_pages.settle()
    assert staged.registered == {} and staged.device_memory == {}


def test_a_run_of_gathered_arrays_stacks_as_a_view_where_nothing_lies_between_them():
    specs = [((1, 2, 4, 8), "uint16")] * 3 + [((1, 2, 3, 3), "uint16")] * 2
    starts = one_buffer.buffer_starts(specs)
    flat = mx.array(np.arange(starts[-1], dtype=np.uint8))
    views = one_buffer.views_in(flat, specs)
    whole = one_buffer.stacked_view(flat, specs, 0, 3)
    assert whole is not None and whole.shape == (3, 2, 4, 8)
    for i, view in enumerate(views[:3]):
        assert mx.array_equal(whole[i : i + 1], view).item()
    assert one_buffer.stacked_view(flat, specs, 2, 2) is None  # another shape
    assert one_buffer.stacked_view(flat, specs, 3, 2) is None  # 36 bytes each: padded to 48


@pytest.mark.parametrize("policy", ["kv:quant:8:64", "kv:turboquant:4:4"])
def test_a_lossy_restore_of_windowed_and_global_layers_equals_the_cpu_restore(
    tmp_path, staged, policy
):
    """Sliding-window and global layers under a lossy storage policy: the windowed
    layers' decoded rows reach their caches cut from the decoded stack (joined by a
    concatenation each: a cut piece is not a whole member of it), the lone global
    layer's decoded alone; bit-exact against the restore without CUDA."""
    model = model_for("tiny-gemma3")
    tokens = prompt(10, 3 * BLOCK + 9)
    with open_store(f"lmdb://{tmp_path / 's'}", block_size=BLOCK, storage_policy=policy) as store:
        store.save("ns", tokens, prefilled(model, tokens, None))
        match = store.lookup("ns", tokens)
        on_device = store.restore(match, model.make_cache())
        assert staged.assembled_many == []
        staged_transport = cuda.TRANSPORT
        try:
            cuda.TRANSPORT = False
            plain = store.restore(match, model.make_cache())
        finally:
            cuda.TRANSPORT = staged_transport
    assert [int(c.offset) for c in on_device] == [len(tokens) - 1] * len(on_device)
    assert_same_caches(on_device, plain)


@pytest.mark.parametrize("policy", ["kv:quant:8:64", "kv:turboquant:4:4"])
def test_a_lossy_restore_makes_every_joins_segments_in_one_go_and_equals_the_cpu_restore(
    tmp_path, staged, monkeypatch, policy
):
    # Every layer reads the same records, laid out alike: the segments of all the joins
    # are made at once, from each tensor name's kind (gather_tables.stacked_table: one spec
    # per name), no layout made per join.
    made, per_join = [], []
    real_table = gather_tables.stacked_table
    monkeypatch.setattr(
        gather_tables,
        "stacked_table",
        lambda rows, specs: made.append(len(specs)) or real_table(rows, specs),
    )
    real_layout = gather_tables.alike_layout
    monkeypatch.setattr(
        gather_tables, "alike_layout", lambda *a: per_join.append(1) or real_layout(*a)
    )
    from kvstore.store.kv import restore as restoring

    decodes: list[int] = []  # records decoded into a snapshot per layer
    real_decoded = restoring._decoded
    monkeypatch.setattr(
        restoring,
        "_decoded",
        lambda views, *a: decodes.append(len(views)) or real_decoded(views, *a),
    )
    model = model_for("tiny")
    tokens = prompt(31, 4 * BLOCK)  # whole blocks: every record of one layout
    with open_store(f"lmdb://{tmp_path / 's'}", block_size=BLOCK, storage_policy=policy) as store:
        store.save("ns", tokens, token_by_token(model, tokens))
        match = store.lookup("ns", tokens)
        on_device = store.restore(match, model.make_cache())
        assert made and per_join == [] and staged.gathers >= 1 and staged.uploads == 0
        # ...from the headers: no record decoded into a snapshot per layer first
        # (alike_joins.joined_records)
        assert decodes == []
        # one spec per tensor name a layer joins (TurboQuant: codes and scales of keys
        # and of values; q8: also the biases), not one per (layer, name)
        assert made == [4 if policy.startswith("kv:turboquant") else 6]
        monkeypatch.setattr(cuda, "TRANSPORT", False)
        plain = store.restore(match, model.make_cache())
    assert int(on_device[0].offset) == len(tokens) - 1
    assert_same_caches(on_device, plain)


@pytest.mark.parametrize("early", [True, False])
@pytest.mark.parametrize("policy", ["kv:quant:8:64", "kv:turboquant:4:4"])
def test_a_lossy_restore_queues_its_decode_early_unless_told_not_to_and_equals_the_cpu_restore(
    tmp_path, staged, monkeypatch, policy, early
):
    # By default the stacked decode is queued on the device as soon as it is made, the
    # caches' joins evaluated after; KVSTORE_EARLY_DECODE=0 evaluates them together, as
    # before. The same caches either way.
    from kvstore.store.kv import restore as restoring

    assert restoring.EARLY_DECODE  # the default
    queued: list[list[mx.array]] = []
    real_async = mx.async_eval
    monkeypatch.setattr(restoring, "EARLY_DECODE", early)
    monkeypatch.setattr(mx, "async_eval", lambda *a: queued.append(list(a[0])) or real_async(*a))
    model = model_for("tiny")
    tokens = prompt(37, 4 * BLOCK)
    with open_store(f"lmdb://{tmp_path / 's'}", block_size=BLOCK, storage_policy=policy) as store:
        store.save("ns", tokens, token_by_token(model, tokens))
        match = store.lookup("ns", tokens)
        on_device = store.restore(match, model.make_cache())
        decodes = [q for q in queued if q and all(a.dtype == mx.float32 for a in q)]
        if early:  # keys and values, each one stack of every layer's rows
            assert decodes and [a.shape[0] for a in decodes[0]] == [len(model.layers)] * 2
        else:
            assert decodes == []
        monkeypatch.setattr(cuda, "TRANSPORT", False)
        plain = store.restore(match, model.make_cache())
    assert_same_caches(on_device, plain)


def test_joins_from_headers_are_declined_unless_every_layer_of_every_record_is_alike(
    tmp_path, staged
):
    """alike_joins.joined_records joins the records' rows from their headers only when
    they follow one another and describe every layer alike: records out of order, of
    another model's layout, or missing a layer give None (the restore then decodes them
    and joins them as they are)."""
    from kvstore.codecs import plans, record
    from kvstore.codecs.alike_joins import joined_records

    def saved(config: str, seed: int) -> tuple[list[bytes], list]:
        model = model_for(config)
        tokens = prompt(seed, 3 * BLOCK)
        url = f"lmdb://{tmp_path / config}"
        with open_store(url, block_size=BLOCK, storage_policy="kv:turboquant:4:4") as store:
            store.save("ns", tokens, token_by_token(model, tokens))
            match = store.lookup("ns", tokens)
            with store.read_checking(list(match.blocks)) as views:
                raw = [bytes(view) for view in views]
        return raw, [record.read_header(r) for r in raw]

    raw, headers = saved("tiny", 3)
    views = [memoryview(bytearray(r)) for r in raw]  # pages of their own, as a read's
    payloads = [record.record_payload(v, h) for v, h in zip(views, headers, strict=True)]
    layers = [h.layers for h in headers]
    pages = cuda_pages.pin(views)
    try:
        stacks: list[plans.Stack] = []
        joined = joined_records(layers, payloads, [None] * 3, pages, stacks)
        assert joined is not None and len(joined) == len(layers[0]) and stacks
        assert all(len(layer) == 1 and layer[0].stop == 3 * BLOCK for layer in joined)
        mx.eval([t for layer in joined for t in layer[0].tensors.values()])
        swapped = [layers[1], layers[0], layers[2]]
        assert joined_records(swapped, payloads, [None] * 3, pages, []) is None
        _, other = saved("tiny-gemma3", 4)
        assert (
            joined_records([layers[0], other[1].layers], payloads[:2], [None] * 2, pages, [])
            is None
        )
        missing = [(None, *layers[0][1:]), layers[1], layers[2]]
        assert joined_records(missing, payloads, [None] * 3, pages, []) is None
    finally:
        pages.release()


def test_with_alike_joins_switched_off_a_lossy_restore_joins_per_layer_and_equals_the_cpu_restore(
    tmp_path, staged, monkeypatch
):
    """KVSTORE_ALIKE_JOINS=0 (the device A/B's other side): records decoded, each layer's
    rows joined per (layer, name) by join_runs, no table made per tensor name; the same
    caches."""
    from kvstore.codecs import alike_joins
    from kvstore.store.kv import restore as restoring

    monkeypatch.setattr(alike_joins, "ALIKE_JOINS", False)
    decodes, per_name = [], []
    real_decoded, real_table = restoring._decoded, gather_tables.stacked_table
    monkeypatch.setattr(
        restoring,
        "_decoded",
        lambda views, *a: decodes.append(len(views)) or real_decoded(views, *a),
    )
    monkeypatch.setattr(
        gather_tables, "stacked_table", lambda *a: per_name.append(1) or real_table(*a)
    )
    model = model_for("tiny")
    tokens = prompt(41, 4 * BLOCK)
    url = f"lmdb://{tmp_path / 's'}"
    with open_store(url, block_size=BLOCK, storage_policy="kv:turboquant:4:4") as store:
        store.save("ns", tokens, token_by_token(model, tokens))
        match = store.lookup("ns", tokens)
        on_device = store.restore(match, model.make_cache())
        assert decodes == [4] and per_name == [] and staged.gathers >= 1
        monkeypatch.setattr(cuda, "TRANSPORT", False)
        plain = store.restore(match, model.make_cache())
    assert_same_caches(on_device, plain)
