"""Arrays allocated by MLX's loader and written straight into (``kvstore.codecs.fill``)."""

from __future__ import annotations

import sys
import threading
import time

import mlx.core as mx
import numpy as np
import pytest

from kvstore.codecs import fill as fill_module
from kvstore.codecs import get_codec, snapshot_held
from kvstore.codecs.arrays import numpy_dtype, owned_arrays
from kvstore.codecs.fill import LeafStream, filled_arrays
from kvstore.codecs.plans import run_plans
from kvstore.testing.codec import fill_cache

from .helpers import FAMILIES

SPECS = [
    ((1, 2, 37, 64), "float16"),
    ((1, 2, 37, 64), "bfloat16"),
    ((3, 5), "float32"),
    ((1, 2, 37, 8), "uint32"),
    ((4,), "int8"),
]


def sources(specs=SPECS, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for shape, name in specs:
        words = rng.integers(0, 256, int(np.prod(shape)) * numpy_dtype(name).itemsize, np.uint8)
        out.append(words.view(numpy_dtype(name)).reshape(shape))
    return out


def writer(values):
    def fill(i, view):
        np.copyto(view, values[i])

    return fill


def as_bytes(array: mx.array) -> bytes:
    return bytes(memoryview(array))


@pytest.mark.parametrize("direct", [True, False])
def test_arrays_hold_every_byte_written_in_their_shape_and_dtype(direct):
    values = sources()
    arrays = filled_arrays(SPECS, writer(values), direct=direct)
    assert [(tuple(a.shape), str(a.dtype).removeprefix("mlx.core.")) for a in arrays] == SPECS
    assert [as_bytes(a) for a in arrays] == [v.tobytes() for v in values]


def test_arrays_are_owned_copies_of_what_was_written():
    values = sources()
    arrays = filled_arrays(SPECS, writer(values), direct=True)
    before = [as_bytes(a) for a in arrays]
    for v in values:
        v.view(np.uint8)[...] ^= 0xFF
    assert [as_bytes(a) for a in arrays] == before


def test_a_small_restores_arrays_are_copies_of_its_host_buffers_each_its_own():
    # Under DIRECT_MIN_BYTES each array is written into a host buffer and copied into
    # MLX's memory: a buffer written again afterwards changes nothing, and no two
    # arrays (nor an array and a buffer) share memory.
    values = sources()
    given = []

    def fill(i, view):
        given.append(view)
        np.copyto(view, values[i])

    arrays = filled_arrays(SPECS, fill, direct=False)
    before = [as_bytes(a) for a in arrays]
    assert before == [v.tobytes() for v in values]
    for view in given:
        view.view(np.uint8)[...] ^= 0xFF
    assert [as_bytes(a) for a in arrays] == before
    addresses = {np.asarray(a.view(mx.uint8)).ctypes.data for a in arrays}
    assert len(addresses) == len(arrays)
    assert not addresses & {view.ctypes.data for view in given}


def test_a_write_that_fails_once_falls_back_and_still_fills_every_array():
    values = sources()
    failed = []

    def flaky(i, view):
        if i == 2 and not failed:
            failed.append(i)
            raise OSError("page went away")
        np.copyto(view, values[i])

    arrays = filled_arrays(SPECS, flaky, direct=True)
    assert failed == [2]
    assert [as_bytes(a) for a in arrays] == [v.tobytes() for v in values]


def test_a_write_that_always_fails_raises_to_the_caller():
    def broken(i, view):
        raise OSError(f"array {i} cannot be read")

    with pytest.raises(OSError, match="array 0 cannot be read"):
        filled_arrays(SPECS, broken, direct=True)


def test_a_stream_read_not_covering_one_whole_array_is_a_problem():
    stream = LeafStream(SPECS[:2])
    header = int.from_bytes(_read(stream, 0, 8), "little") + 8
    _read(stream, header + 16, 64)
    assert not stream.complete
    assert "is not one array" in stream.problem


def test_an_array_read_twice_is_a_problem():
    specs = SPECS[2:3]
    stream = LeafStream(specs)
    header = int.from_bytes(_read(stream, 0, 8), "little") + 8
    nbytes = 3 * 5 * 4
    _read(stream, header, nbytes)
    assert stream.complete
    _read(stream, header, nbytes)
    assert not stream.complete and "read twice" in stream.problem


def test_the_default_uses_the_loader_only_for_large_restores(monkeypatch):
    calls = []
    real_load = mx.load

    def counting_load(*args, **kwargs):
        calls.append(args)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(fill_module.mx, "load", counting_load)
    values = sources()
    filled_arrays(SPECS, writer(values))
    assert calls == []
    monkeypatch.setattr(fill_module, "DIRECT_MIN_BYTES", 0)
    arrays = filled_arrays(SPECS, writer(values))
    assert len(calls) == 1
    assert [as_bytes(a) for a in arrays] == [v.tobytes() for v in values]


def _read(stream: LeafStream, offset: int, n: int) -> bytes:
    stream.seek(offset)
    buffer = bytearray(n)
    assert stream.readinto(memoryview(buffer)) == n
    return bytes(buffer)


def test_mlx_has_dropped_its_reader_when_the_arrays_are_returned(monkeypatch):
    # A reader dropped later, on an MLX thread, aborts the process at exit.
    streams = []

    class Recorded(LeafStream):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            streams.append(self)

    monkeypatch.setattr(fill_module, "LeafStream", Recorded)
    specs = [((1, 8, 64, 128), "float16")] * 32
    held = []
    for _ in range(300):
        filled_arrays(specs, lambda i, view: view.fill(1), direct=True)
        held.append(sys.getrefcount(streams.pop()))
    assert set(held) == {1}  # getrefcount's own: nothing else holds the stream


def test_the_loaders_io_threads_keep_their_python_state_from_one_array_to_the_next():
    # MLX reads each array on one of its own I/O threads, which Python did not start:
    # without their states kept, every read would find its threading.local empty again.
    local = threading.local()
    seen: dict[int, list[int]] = {}

    class Counting(LeafStream):
        def seek(self, offset, whence=0):
            position = super().seek(offset, whence)
            local.reads = getattr(local, "reads", 0) + 1
            seen.setdefault(threading.get_ident(), []).append(local.reads)
            return position

    for _ in range(20):
        stream = Counting([((64,), "uint8")] * 8)
        mx.load(stream, format="safetensors")
        assert stream.complete
    seen.pop(threading.get_ident(), None)  # the header, read on this thread
    assert sum(map(len, seen.values())) == 160  # every array read on an I/O thread
    assert all(reads == list(range(1, len(reads) + 1)) for reads in seen.values())
    assert max(map(len, seen.values())) > 1


@pytest.mark.parametrize("family", ["plain", "quant-4-64", "rotating-keep4", "tq-4-3"])
def test_a_plan_finished_on_zeroed_buffers_equals_the_direct_fill(family):
    # CachePlan.finish (the RestorePlan protocol) and run_plans (filled_arrays) must agree.
    cache = FAMILIES[family]()
    fill_cache(cache, [20, 1, 30])
    snapshots = snapshot_held(cache)
    codec = get_codec(snapshots[0].signature)
    plan = codec.plan_restore(snapshots)
    by_finish = plan.finish(owned_arrays(list(plan.leaves)))
    (by_run,) = run_plans([codec.plan_restore(snapshots)])
    for a, b in zip(
        (x for s in snapshot_held(by_finish) for x in s.tensors.values()),
        (x for s in snapshot_held(by_run) for x in s.tensors.values()),
        strict=True,
    ):
        assert mx.array_equal(a, b).item()
    assert by_finish.offset == by_run.offset == cache.offset


@pytest.mark.parametrize("direct", [True, False])
def test_the_loaders_arrays_are_written_on_every_core_and_the_fallbacks_on_the_caller(
    monkeypatch, direct
):
    # Every array allocated first, then written at once on several threads; the
    # copied way (small restores, and the fallback) writes them one after another here.
    import threading

    monkeypatch.setenv("KVSTORE_COPY_THREADS", "2")
    values = sources()
    write = writer(values)
    seen: set[int] = set()
    lock = threading.Lock()

    def fill(i, view):
        with lock:
            seen.add(threading.get_ident())
        write(i, view)
        time.sleep(0.01)  # long enough for the other thread to take the next array

    arrays = filled_arrays(SPECS, fill, direct=direct)
    assert [as_bytes(a) for a in arrays] == [v.tobytes() for v in values]
    assert len(seen) == 2 if direct else seen == {threading.get_ident()}


def test_a_restores_writes_on_several_threads_ask_mlx_nothing(monkeypatch):
    # MLX's evaluation is not thread-safe before 0.31.2 (mlx>=0.29 is allowed): the
    # pieces' views (a bfloat16 MLX piece's is an MLX op) are made before the writes.
    from kvstore.codecs import copies

    monkeypatch.setenv("KVSTORE_COPY_THREADS", "2")
    monkeypatch.setattr(fill_module, "DIRECT_MIN_BYTES", 0)
    cache = FAMILIES["plain"]()
    fill_cache(cache, [20, 1, 30])
    snapshots = snapshot_held(cache)
    assert any(isinstance(t, mx.array) for s in snapshots for t in s.tensors.values())
    codec = get_codec(snapshots[0].signature)
    writing, evals_while_writing = [], []
    real_eval, real_each = mx.eval, copies.each_on_threads

    def recorded_eval(*args, **kwargs):
        if writing:
            evals_while_writing.append(args)
        return real_eval(*args, **kwargs)

    def recorded_each(count, work):
        writing.append(count)
        try:
            return real_each(count, work)
        finally:
            writing.clear()

    monkeypatch.setattr(mx, "eval", recorded_eval)
    monkeypatch.setattr(fill_module, "each_on_threads", recorded_each)
    (restored,) = run_plans([codec.plan_restore(snapshots)])
    assert writing == [] and evals_while_writing == []
    for a, b in zip(
        (x for s in snapshot_held(restored) for x in s.tensors.values()),
        (x for s in snapshots for x in s.tensors.values()),
        strict=True,
    ):
        assert mx.array_equal(a, b).item()


@pytest.mark.parametrize(
    ("count", "shape", "loader"),
    [
        (40, (1, 2, 4096, 64), True),  # 40 MiB in arrays of 1 MiB: the loader's
        (16, (1, 2, 8192, 64), True),  # 32 MiB in arrays of 2 MiB: the loader's
        (640, (1, 2, 256, 64), True),  # 40 MiB in arrays of 64 KiB: the loader's
        (4, (1, 2, 4096, 64), False),  # 4 MiB in all: copied
        (15, (1, 2, 4096, 64), False),  # 15 MiB in all: copied
        (16, (1, 2, 4096, 64), True),  # 16 MiB in all: the loader's
    ],
)
def test_a_restore_takes_the_loader_for_many_bytes_whatever_its_arrays_sizes(
    monkeypatch, count, shape, loader
):
    # The loader allocates a few buffers, not an array each: its cost no longer grows
    # with the arrays' count, so only the bytes in all choose.
    loaded = []
    allocated = fill_module._allocated

    def counting(specs, align=None):
        loaded.append(len(specs))
        return allocated(specs, align)

    monkeypatch.setattr(fill_module, "_allocated", counting)
    specs = [(shape, "bfloat16")] * count
    arrays = filled_arrays(specs, lambda i, view: view.fill(i))
    assert loaded == ([count] if loader else [])
    assert [int(np.asarray(a.view(mx.uint16)).max()) for a in arrays] == list(range(count))


def _buffer_of(array: mx.array) -> int:
    return np.asarray(array.view(mx.uint8)).ctypes.data


def test_the_loaders_arrays_are_views_of_buffers_of_at_most_the_cap_each(monkeypatch):
    # 10 arrays of 1 MiB, 3 MiB a buffer: buffers of 3, 3, 3 and 1 arrays, each array
    # starting where the one before it ends (1 MiB is whole 16-byte words).
    monkeypatch.setattr(fill_module, "BUFFER_MAX_BYTES", 3 << 20)
    shape = (1, 2, 4096, 64)
    specs = [(shape, "bfloat16")] * 10
    arrays = filled_arrays(specs, lambda i, view: view.fill(i + 1), direct=True)
    starts = [_buffer_of(a) for a in arrays]
    mib = 1 << 20
    for group in ([0, 1, 2], [3, 4, 5], [6, 7, 8]):
        assert [starts[i] - starts[group[0]] for i in group] == [0, mib, 2 * mib]
    assert [int(np.asarray(a.view(mx.uint16)).min()) for a in arrays] == list(range(1, 11))
    assert all(a.shape == shape and a.dtype == mx.bfloat16 for a in arrays)


def test_large_arrays_get_a_buffer_each_and_a_step_writes_them_in_place(monkeypatch):
    # MLX writes into an array in place only when no other array shares its buffer: a
    # cache's first step after a restore would copy a shared one whole. Arrays from
    # OWN_BUFFER_MIN_BYTES get their own; smaller ones still share.
    monkeypatch.setattr(fill_module, "OWN_BUFFER_MIN_BYTES", 256 << 10)
    big, small = (1, 2, 2048, 64), (1, 2, 256, 64)  # 512 and 64 KiB of bfloat16
    specs = [(big, "bfloat16"), (small, "bfloat16"), (small, "bfloat16"), (big, "bfloat16")]
    values = sources(specs, seed=5)
    arrays = filled_arrays(specs, writer(values), direct=True)
    starts = [_buffer_of(a) for a in arrays]
    assert starts[2] - starts[1] == 64 << 10  # the small ones: one buffer
    assert len({starts[0], starts[1], starts[3]}) == 3
    row = mx.ones((1, 2, 1, 64), mx.bfloat16)
    for i in range(4):
        arrays[i][..., 7:8, :] = row
    mx.eval(arrays)
    moved = [_buffer_of(a) != start for a, start in zip(arrays, starts, strict=True)]
    assert moved == [False, True, True, False]
    one = np.asarray(row.view(mx.uint16))[..., 0, :]
    for a, v in zip(arrays, values, strict=True):
        bits = np.asarray(a.view(mx.uint16))
        assert (bits[..., 7, :] == one).all()
        assert np.array_equal(bits[..., 8:, :], v.view(np.uint16)[..., 8:, :])
        assert np.array_equal(bits[..., :7, :], v.view(np.uint16)[..., :7, :])


def test_an_array_written_in_place_after_a_restore_leaves_its_neighbours_alone():
    # The loader's arrays share a buffer: a cache writing one of them in place (a
    # rotating cache's next token) or growing one (a concatenation) changes that one
    # alone.
    values = sources([((1, 2, 2048, 64), "bfloat16")] * 4, seed=3)
    arrays = filled_arrays([((1, 2, 2048, 64), "bfloat16")] * 4, writer(values), direct=True)
    assert len({_buffer_of(a) - i * (1 << 19) for i, a in enumerate(arrays)}) == 1
    before = [as_bytes(a) for a in arrays]
    arrays[1][..., 0:8, :] = mx.ones((1, 2, 8, 64), mx.bfloat16)
    grown = mx.concatenate([arrays[2], mx.zeros((1, 2, 256, 64), mx.bfloat16)], axis=2)
    mx.eval(arrays[1], grown)
    assert as_bytes(arrays[0]) == before[0] and as_bytes(arrays[3]) == before[3]
    assert as_bytes(arrays[2]) == before[2]
    assert as_bytes(grown[..., :2048, :]) == before[2]
    assert (np.asarray(arrays[1].astype(mx.float32))[..., :8, :] == 1).all()
    assert as_bytes(arrays[1][..., 8:, :]) == bytes(memoryview(values[1][..., 8:, :].copy()))


@pytest.mark.parametrize("align", [0, 16, 48])
def test_arrays_start_where_their_rows_lie_modulo_the_alignment(align):
    # Copies run fastest between addresses alike modulo fill.ALIGN_BYTES: the first
    # array of each loader buffer is placed so (the others follow on 64-byte multiples
    # here).
    specs = [((1, 2, 64, 64), "float16"), ((1, 2, 64, 64), "bfloat16")] * 3
    values = sources(specs, seed=3)
    given = []

    def fill(i, view):
        given.append(view.ctypes.data)
        np.copyto(view, values[i])

    arrays = filled_arrays(specs, fill, direct=True, align=align)
    assert [as_bytes(a) for a in arrays] == [v.tobytes() for v in values]
    assert {address % fill_module.ALIGN_BYTES for address in given} == {align}
    # The views written are the arrays' own memory.
    assert sorted(given) == sorted(np.asarray(a.view(mx.uint8)).ctypes.data for a in arrays)


def test_the_most_common_alignment_of_the_sources_is_the_one_asked_for():
    assert fill_module.common_alignment([64 + 16, 128 + 16, 200]) == 16
    assert fill_module.common_alignment([]) is None


@pytest.mark.parametrize(("value", "nbytes"), [("", 4 << 20), ("1", 1 << 20), ("0.5", 1 << 19)])
def test_the_own_buffer_threshold_is_read_from_the_environment(value, nbytes):
    # KVSTORE_OWN_BUFFER_MIB: where a new session's first token matters more than the
    # restore alone, smaller arrays get buffers of their own too.
    import subprocess

    done = subprocess.run(
        [sys.executable, "-c", "import kvstore.codecs.fill as f; print(f.OWN_BUFFER_MIN_BYTES)"],
        env={"KVSTORE_OWN_BUFFER_MIB": value, "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) == nbytes
