"""The CUDA staging path (kvstore.codecs.cuda) with its transport swapped for host memory:
the threading, slots, layouts and record arenas run here as they do on a GPU, and restores
and saves through it are bit-exact. (The kernels themselves run on the device machine:
tools/bench/gpu/run.sh checks them there before any figure.)"""

from __future__ import annotations

import ctypes
import mmap
import threading

import mlx.core as mx
import numpy as np
import pytest

from kvstore.codecs import cuda
from kvstore.codecs.arena import write_records
from kvstore.codecs.record import encode_record, plan_record
from kvstore.store import open_store

#: Where the stand-in's "GPU" sees registered pages: elsewhere than the host, so a
#: gather that used a host address unconverted would read the wrong bytes (and fault).
DEVICE_OFFSET = 1 << 44


class HostTransport:
    """What a GPU does, in host memory: a slot's bytes become an array, and back;
    registered pages are read through their "device" addresses."""

    def __init__(self) -> None:
        self.uploads = 0
        self.downloads = 0
        self.gathers = 0
        self.assembles = 0
        #: The arrays each :meth:`assemble_many` made.
        self.assembled_many: list[int] = []
        self.registrations = 0
        self.registered: dict[int, int] = {}
        self.refuse = False
        #: Device memory handed out (:meth:`staging`) and its copies; ``no_staging``
        #: refuses it, as a device without room does.
        self.stagings: list[HostStaging] = []
        self.no_staging = False
        #: The stagings' memory not freed yet, by address (a gather reads it as it
        #: reads registered pages).
        self.device_memory: dict[int, int] = {}
        #: The pinned slots made (a copy from one needs no registration).
        self.slots: list[cuda.PinnedBuffer] = []
        #: The ``copy`` route's arrays by their "device" address, and the threads that
        #: copied each down (:meth:`copy_down`).
        self.device_arrays: dict[int, np.ndarray] = {}
        self.copied_on: list[str] = []
        #: Make the ``copy`` route's calls fail, as a driver that refuses them would.
        self.refuse_addresses = self.refuse_copies = False

    def slot(self, nbytes: int) -> cuda.PinnedBuffer:
        made = cuda.PinnedBuffer(nbytes, None)
        self.slots.append(made)
        return made

    def in_a_slot(self, start: int, end: int) -> bool:
        """Whether one pinned slot holds every byte of [start, end)."""
        return any(
            s.array.ctypes.data <= start and end <= s.array.ctypes.data + s.nbytes
            for s in list(self.slots)
        )

    def to_device(self, slot: cuda.PinnedBuffer, nbytes: int) -> mx.array:
        self.uploads += 1
        out = mx.array(slot.array[:nbytes].copy())
        mx.eval(out)
        return out

    def to_host(self, array: mx.array, slot: cuda.PinnedBuffer, offset: int) -> None:
        self.downloads += 1
        data = np.asarray(array)
        slot.array[offset : offset + data.nbytes] = data

    def addresses(self, arrays) -> list[int]:
        if self.refuse_addresses:
            raise RuntimeError("[cuda] the address kernel failed.")
        out = []
        for array in arrays:
            data = np.asarray(array)
            assert data.dtype == np.uint8 and data.ndim == 1
            out.append(int(data.ctypes.data) + DEVICE_OFFSET)
            self.device_arrays[out[-1]] = data
        return out

    def copy_down(self, address: int, slot: cuda.PinnedBuffer, offset: int, nbytes: int) -> None:
        if self.refuse_copies:
            raise RuntimeError("[cuda] cuMemcpyDtoHAsync failed with CUresult 700.")
        data = self.device_arrays[address]
        assert nbytes == data.nbytes and offset + nbytes <= slot.nbytes
        slot.array[offset : offset + nbytes] = data
        self.downloads += 1
        self.copied_on.append(threading.current_thread().name)

    def register(self, base: int, nbytes: int) -> int:
        if self.refuse:
            raise RuntimeError("[cuda] cuMemHostRegister failed with CUresult 2.")
        assert base % mmap.PAGESIZE == 0 and nbytes % mmap.PAGESIZE == 0
        assert all(base + nbytes <= b or b + n <= base for b, n in self.registered.items())
        self.registered[base] = nbytes
        self.registrations += 1
        return base + DEVICE_OFFSET

    def unregister(self, base: int) -> None:
        del self.registered[base]

    def staging(self, nbytes: int) -> HostStaging | None:
        if self.no_staging:
            return None
        self.stagings.append(HostStaging(self, nbytes))
        return self.stagings[-1]

    def covered(self, start: int, end: int) -> bool:
        """Whether one registered region holds every byte of [start, end)."""
        # dict() copies in one step: other threads register meanwhile.
        held = {**dict(self.registered), **dict(self.device_memory)}
        return any(b <= start and end <= b + n for b, n in held.items())

    def gather(self, params: np.ndarray, nbytes: int) -> mx.array:
        self.gathers += 1
        return mx.array(self._segments(params, [nbytes], bits=None)[0])

    def gather_many(self, params: np.ndarray, nbytes) -> list[mx.array]:
        """One gather kernel of several outputs: each segment's ``dst_offset`` names its
        output (high bits) and an offset into it."""
        assert 0 < len(nbytes) <= cuda.GATHER_OUTPUTS
        self.gathers += 1
        outs = self._segments(params, nbytes, bits=cuda.OUTPUT_OFFSET_BITS)
        return [mx.array(out) for out in outs]

    def _segments(self, params: np.ndarray, nbytes, bits: int | None) -> list[np.ndarray]:
        """The gather kernel's segments written into new outputs of ``nbytes``; ``bits``:
        where a ``dst_offset``'s output number starts (``None``: one output)."""
        outs = [np.full(n, 0xAB, np.uint8) for n in nbytes]  # bytes no segment writes show up
        words = params[1:].reshape(int(params[0]), cuda.SEGMENT_WORDS).tolist()
        for src, src_pitch, offset, pitch, width, height in words:
            out = outs[0 if bits is None else offset >> bits]
            offset &= (1 << (bits or 64)) - 1
            assert offset + (height - 1) * pitch + width <= out.size
            for r in range(height):
                at = out.ctypes.data + offset + r * pitch
                if not src:
                    ctypes.memset(at, 0, width)
                    continue
                host = src - DEVICE_OFFSET + r * src_pitch
                assert self.covered(host, host + width)
                ctypes.memmove(at, host, width)
        return outs

    def assemble(self, params: np.ndarray, buffers, nbytes: int) -> mx.array:
        """The assemble kernel's segments, each ``src`` a buffer's number + 1 (high
        bits) and an offset into it."""
        self.assembles += 1
        return mx.array(self._assembled(params, buffers, [nbytes], bits=None)[0])

    def assemble_many(self, params: np.ndarray, buffers, nbytes) -> list[mx.array]:
        """One assemble kernel of several outputs: each segment's ``dst_offset`` names
        its output (high bits) and an offset into it."""
        assert 0 < len(nbytes) <= cuda.GATHER_OUTPUTS
        self.assembled_many.append(len(nbytes))
        outs = self._assembled(params, buffers, nbytes, bits=cuda.OUTPUT_OFFSET_BITS)
        return [mx.array(out) for out in outs]

    def _assembled(self, params: np.ndarray, buffers, nbytes, bits: int | None) -> list[np.ndarray]:
        assert len(buffers) <= cuda.ASSEMBLE_INPUTS
        assert all(b.dtype == mx.uint8 and b.ndim == 1 for b in buffers)
        sources = [np.array(buffer) for buffer in buffers]
        outs = [np.full(n, 0xAB, np.uint8) for n in nbytes]  # bytes no segment writes show up
        words = params[1:].reshape(int(params[0]), cuda.SEGMENT_WORDS).tolist()
        at_bits = cuda.ASSEMBLE_OFFSET_BITS
        for src, src_pitch, offset, pitch, width, height in words:
            out = outs[0 if bits is None else offset >> bits]
            offset &= (1 << (bits or 64)) - 1
            assert offset + (height - 1) * pitch + width <= out.size
            for r in range(height):
                at = offset + r * pitch
                if not src:
                    out[at : at + width] = 0
                    continue
                source = sources[(src >> at_bits) - 1]
                first = (src & ((1 << at_bits) - 1)) + r * src_pitch
                assert first + width <= source.size
                out[at : at + width] = source[first : first + width]
        return outs


class HostStaging:
    """ "Device" memory spans are copied into: a host buffer the stand-in's gather reads
    through its "device" address, as it reads registered pages. A copy may only read
    pages that are registered (the copy engine reads page-locked memory)."""

    def __init__(self, transport: HostTransport, nbytes: int) -> None:
        self.transport = transport
        self.buffer = np.full(max(16, nbytes), 0xCD, np.uint8)  # bytes no copy wrote show up
        self.host = int(self.buffer.ctypes.data)
        self.address = self.host + DEVICE_OFFSET
        self.copies = 0
        self.freed = False
        transport.device_memory[self.host] = self.buffer.size

    def copy(self, offset: int, host: int, nbytes: int) -> None:
        assert not self.freed and offset + nbytes <= self.buffer.size
        registered = dict(self.transport.registered)
        assert any(b <= host and host + nbytes <= b + n for b, n in registered.items())
        ctypes.memmove(self.host + offset, host, nbytes)
        self.copies += 1

    def copy_now(self, offset: int, host: int, nbytes: int) -> None:
        """A copy from a pinned slot (the ``copy`` route), done when this returns."""
        assert not self.freed and offset + nbytes <= self.buffer.size
        assert self.transport.in_a_slot(host, host + nbytes)
        if self.transport.refuse:
            raise RuntimeError("[cuda] cuMemcpyHtoDAsync failed with CUresult 2.")
        ctypes.memmove(self.host + offset, host, nbytes)
        self.copies += 1

    def wait(self) -> None:
        assert not self.freed

    def free(self) -> None:
        assert not self.freed, "freed twice"
        self.freed = True
        del self.transport.device_memory[self.host]


def host_transport(monkeypatch) -> HostTransport:
    """A :class:`HostTransport` as this process's CUDA transport until the test ends."""
    transport = HostTransport()
    monkeypatch.setattr(cuda, "TRANSPORT", transport)
    return transport


@pytest.fixture
def staged(monkeypatch):
    return host_transport(monkeypatch)


def test_upload_fills_every_array_from_its_slot(staged):
    specs = [((1, 2, 5, 8), "bfloat16"), ((3, 7), "float32"), ((11,), "uint8"), ((2, 3), "uint32")]
    rng = np.random.default_rng(0)
    want = [rng.integers(0, 200, size=shape).astype(np.float32) for shape, _ in specs]

    def fill(i, view):
        view[...] = want[i].astype(view.dtype)

    arrays = cuda.upload(specs, fill)
    assert staged.uploads == len(specs)
    for array, (shape, name), expect in zip(arrays, specs, want, strict=True):
        assert tuple(array.shape) == shape and str(array.dtype).endswith(name)
        if name != "bfloat16":
            assert np.array_equal(np.array(array).astype(np.float32), expect)


def test_a_restore_through_staging_is_the_cpu_restore(tmp_path, staged):
    from tests.test_store.kv_helpers import (
        BLOCK,
        assert_same_caches,
        model_for,
        prompt,
        token_by_token,
    )

    model = model_for("tiny")
    tokens = prompt(3, 3 * BLOCK + 7)
    caches = token_by_token(model, tokens)
    with open_store(f"lmdb://{tmp_path / 's'}", block_size=BLOCK) as store:
        store.save("ns", tokens, caches)
        restored = store.restore(store.lookup("ns", tokens), model.make_cache())
    assert staged.uploads > 0
    assert_same_caches(restored, token_by_token(model, tokens[:-1]))


@pytest.mark.parametrize("family", ["plain", "window"])
def test_a_staged_lossy_restore_uploads_each_record_whole_and_equals_the_cpu_restore(
    tmp_path, staged, monkeypatch, family
):
    from tests.test_store.kv_helpers import (
        BLOCK,
        FAMILIES,
        assert_same_caches,
        model_for,
        prefilled,
        prompt,
    )

    config, policy = FAMILIES[family]
    model = model_for(config)
    tokens = prompt(5, 5 * BLOCK + 3)
    url = f"lmdb://{tmp_path / 's'}"
    with open_store(url, block_size=BLOCK, storage_policy="kv:quant:8:64") as store:
        store.save("ns", tokens, prefilled(model, tokens, policy))
        match = store.lookup("ns", tokens)
        before = staged.uploads
        restored = store.restore(match, model.make_cache(policy))
        # Stored in another encoding: one upload per record read (a window layer reads
        # fewer), none per array; the rows are joined and decoded on the device.
        assert 0 < staged.uploads - before <= len(match.blocks)
        monkeypatch.setattr(cuda, "TRANSPORT", False)
        plain = store.restore(match, model.make_cache(policy))
    assert int(restored[0].offset) == int(plain[0].offset) > 4 * BLOCK
    assert_same_caches(restored, plain)


def test_records_decoded_on_the_device_equal_host_decodes(staged):
    from kvstore.caches import KVCache
    from kvstore.codecs import codec_for
    from kvstore.codecs.record import decode_record, decode_records_on_device

    cache = KVCache()
    rows = mx.random.normal((1, 2, 40, 64)).astype(mx.bfloat16)
    cache.update_and_fetch(rows, rows * 2)
    codec = codec_for(cache)
    records = [encode_record([codec.snapshot(cache, s, s + 20), None]) for s in (0, 20)]
    on_device = decode_records_on_device(records)
    assert staged.uploads == 2
    for got, record in zip(on_device, records, strict=True):
        want = decode_record(record)
        assert got.layers[1] is None and want.layers[1] is None
        a, b = got.layers[0], want.layers[0]
        assert (a.start, a.stop, a.signature, a.meta) == (b.start, b.stop, b.signature, b.meta)
        for name, array in a.tensors.items():
            assert isinstance(array, mx.array)
            assert np.array_equal(np.array(array.view(mx.uint16)), b.tensors[name].view(np.uint16))


@pytest.mark.parametrize("policy", ["kv:quant:8:64", "kv:turboquant:4:4", "kv:mxfp8", "kv:nvfp4"])
def test_a_lossy_restore_through_staging_decodes_on_the_device_as_the_cpu_does(
    tmp_path, staged, monkeypatch, policy
):
    from tests.test_store.kv_helpers import BLOCK, model_for, prompt, token_by_token

    model = model_for("tiny")
    tokens = prompt(4, 3 * BLOCK + 7)
    caches = token_by_token(model, tokens)
    with open_store(f"lmdb://{tmp_path / 's'}", block_size=BLOCK, storage_policy=policy) as store:
        store.save("ns", tokens, caches)
        match = store.lookup("ns", tokens)
        staged_caches = store.restore(match, model.make_cache())
        monkeypatch.setattr(cuda, "TRANSPORT", False)
        plain = store.restore(match, model.make_cache())
    for a, b in zip(staged_caches, plain, strict=True):
        n = int(a.offset)
        assert n == int(b.offset) == len(tokens) - 1
        assert np.allclose(np.array(a.keys[..., :n, :]), np.array(b.keys[..., :n, :]), atol=1e-6)


def test_records_downloaded_into_a_pinned_arena_equal_encoded_ones(staged):
    from kvstore.caches import KVCache
    from kvstore.codecs import codec_for

    cache = KVCache()
    rows = mx.random.normal((1, 2, 40, 64)).astype(mx.bfloat16)
    cache.update_and_fetch(rows, rows * 2)
    codec = codec_for(cache)
    layers = [[codec.snapshot(cache, s, s + 16), None] for s in (0, 16)]
    records = write_records([plan_record(layer) for layer in layers])
    assert staged.downloads == 2
    assert [bytes(r) for r in records] == [encode_record(layer) for layer in layers]


def test_large_records_hashed_on_the_pool_equal_encoded_ones(staged):
    """Over PARALLEL_MIN_BYTES the pool hashes the records whose payloads were downloaded
    into the pinned arena: the same bytes as encoded on the host."""
    from kvstore.caches import KVCache
    from kvstore.codecs import arena, codec_for

    cache = KVCache()
    rows = mx.random.normal((1, 32, 768, 64))  # 6 MiB a tensor
    cache.update_and_fetch(rows, rows * 3)
    codec = codec_for(cache)
    layers = [[codec.snapshot(cache, s, s + 256)] for s in (0, 256, 512)]
    plans = [plan_record(layer) for layer in layers]
    assert sum(p.nbytes_bound for p in plans) >= arena.PARALLEL_MIN_BYTES
    records = write_records(plans)
    assert staged.downloads == 3
    assert [bytes(r) for r in records] == [encode_record(layer) for layer in layers]


def _large_layers():
    from kvstore.caches import KVCache
    from kvstore.codecs import codec_for

    cache = KVCache()
    rows = mx.random.normal((1, 32, 768, 64))  # 6 MiB a tensor
    cache.update_and_fetch(rows, rows * 3)
    codec = codec_for(cache)
    return [[codec.snapshot(cache, s, s + 256)] for s in (0, 256, 512)]


def test_pending_records_are_hashed_each_once_its_bytes_are_down(staged, monkeypatch):
    """The ``kernel`` route: with ``pending``, each record's write goes to the pool as
    soon as its payload is downloaded (the next one downloading meanwhile), and comes
    back at once as a PendingRecord whose result is the encoded record."""
    from kvstore.abc.store import PendingRecord
    from kvstore.codecs import arena

    monkeypatch.setattr(cuda, "DOWNLOAD_ROUTE", "kernel")
    layers = _large_layers()
    plans = [plan_record(layer) for layer in layers]
    downloaded_at_write: dict[int, int] = {}
    real = arena.write_record

    def spied(plan, out, **kw):
        downloaded_at_write[plans.index(plan)] = staged.downloads
        return real(plan, out, **kw)

    monkeypatch.setattr(arena, "write_record", spied)
    records = write_records(plans, pending=True)
    assert all(isinstance(r, PendingRecord) for r in records)
    assert [r.nbytes_bound for r in records] == [p.nbytes_bound for p in plans]
    assert [bytes(r.result()) for r in records] == [encode_record(layer) for layer in layers]
    assert all(downloaded_at_write[i] >= i + 1 for i in range(3))


def test_on_the_copy_route_the_pool_downloads_each_record_before_hashing_it(staged, monkeypatch):
    """KVSTORE_CUDA_DOWNLOAD_ROUTE=copy: the saving thread only evaluates the payloads and
    reads their addresses; each record is copied down by the pool thread that then
    hashes it, and the records are those encoded on the host."""
    from kvstore.abc.store import PendingRecord
    from kvstore.codecs import arena

    monkeypatch.setattr(cuda, "DOWNLOAD_ROUTE", "copy")
    layers = _large_layers()
    plans = [plan_record(layer) for layer in layers]
    downloaded_before_write: dict[int, bool] = {}
    real = arena.write_record

    def spied(plan, out, **kw):
        head = plan.head_nbytes_bound
        want = np.frombuffer(device_bytes(plan), np.uint8)
        downloaded = np.array_equal(out[head : head + want.size], want)
        downloaded_before_write[plans.index(plan)] = bool(downloaded)
        return real(plan, out, **kw)

    def device_bytes(plan):
        return bytes(np.array(arena.device_payload(plan)))

    monkeypatch.setattr(arena, "write_record", spied)
    records = write_records(plans, pending=True)
    assert all(isinstance(r, PendingRecord) for r in records)
    assert [bytes(r.result()) for r in records] == [encode_record(layer) for layer in layers]
    assert downloaded_before_write == {0: True, 1: True, 2: True}
    assert staged.downloads == 3
    assert all(name.startswith("kvstore-records") for name in staged.copied_on)


@pytest.mark.parametrize("route", ["kernel", "copy"])
def test_a_small_save_downloads_on_the_saving_thread_by_either_route(staged, monkeypatch, route):
    from kvstore.caches import KVCache
    from kvstore.codecs import codec_for

    monkeypatch.setattr(cuda, "DOWNLOAD_ROUTE", route)
    cache = KVCache()
    rows = mx.random.normal((1, 2, 40, 64)).astype(mx.bfloat16)
    cache.update_and_fetch(rows, rows * 2)
    codec = codec_for(cache)
    layers = [[codec.snapshot(cache, s, s + 16)] for s in (0, 16)]
    records = write_records([plan_record(layer) for layer in layers], pending=True)
    assert [bytes(r) for r in records] == [encode_record(layer) for layer in layers]
    assert staged.downloads == 2 and staged.copied_on == []  # to_host, this thread


@pytest.mark.parametrize("pinned", [False, True], ids=["host", "pinned"])
def test_pending_records_below_the_pools_threshold_are_written_at_once(request, pinned):
    if pinned:
        request.getfixturevalue("staged")
    from kvstore.caches import KVCache
    from kvstore.codecs import codec_for

    cache = KVCache()
    rows = mx.random.normal((1, 2, 32, 64))
    cache.update_and_fetch(rows, rows)
    layer = [codec_for(cache).snapshot(cache, 0, 16)]
    (record,) = write_records([plan_record(layer)], pending=True)
    assert isinstance(record, memoryview) and bytes(record) == encode_record(layer)


def test_host_records_written_on_the_pool_come_back_pending_and_free_the_arena(monkeypatch):
    from kvstore.abc.store import PendingRecord
    from kvstore.codecs import arena

    monkeypatch.setattr(cuda, "TRANSPORT", False)  # the host arena
    monkeypatch.setattr(arena, "PARALLEL_MIN_BYTES", 0)
    layers = _large_layers()
    records = write_records([plan_record(layer) for layer in layers], pending=True)
    assert all(isinstance(r, PendingRecord) for r in records)
    written = [r.result() for r in records]
    assert [bytes(r) for r in written] == [encode_record(layer) for layer in layers]
    where = _address(written[0])
    del records, written
    again = write_records([plan_record(layer) for layer in layers], pending=True)
    assert _address(again[0].result()) == where  # nothing held the arena: reused


def test_an_arena_still_referenced_is_not_reused():
    from kvstore.caches import KVCache
    from kvstore.codecs import codec_for

    cache = KVCache()
    rows = mx.random.normal((1, 2, 16, 64))
    cache.update_and_fetch(rows, rows)
    plan = plan_record([codec_for(cache).snapshot(cache, 0, 16)])
    first = write_records([plan])
    kept = bytes(first[0])
    second = write_records([plan_record([codec_for(cache).snapshot(cache, 0, 8)])])
    assert bytes(first[0]) == kept  # the second save took another buffer
    del first, second


def _address(record: memoryview) -> int:
    return int(np.frombuffer(record, np.uint8).ctypes.data)


@pytest.mark.parametrize("pinned", [False, True], ids=["host", "pinned"])
def test_an_arena_nothing_refers_to_is_reused(request, pinned):
    """The next save writes into the same buffer once the records of the last are gone:
    no fresh pages (nor, on a GPU, a new page-locked buffer) per save."""
    from kvstore.caches import KVCache
    from kvstore.codecs import codec_for

    if pinned:
        staged = request.getfixturevalue("staged")
    cache = KVCache()
    rows = mx.random.normal((1, 2, 32, 64))
    cache.update_and_fetch(rows, rows)
    codec = codec_for(cache)
    first = write_records([plan_record([codec.snapshot(cache, 0, 16)])])
    where = _address(first[0])
    del first
    second = write_records([plan_record([codec.snapshot(cache, 16, 32)])])
    assert _address(second[0]) == where
    want = encode_record([codec.snapshot(cache, 16, 32)])
    assert bytes(second[0]) == want
    if pinned:
        assert staged.downloads == 2


def test_in_use_asks_nothing_of_the_device(monkeypatch):
    monkeypatch.setattr(cuda, "TRANSPORT", None)
    assert not cuda.in_use()
    assert cuda.TRANSPORT is None  # nothing set up: a store read alone compiles no kernels
    monkeypatch.setattr(cuda, "TRANSPORT", HostTransport())
    assert cuda.in_use()
    monkeypatch.setattr(cuda, "TRANSPORT", False)
    assert not cuda.in_use()


def _three_layer_encoder(encoder_kind: str, policy: str, batch: int = 1):
    """A save's encoder (``"save"``) or a save behind's (``"handed off"``, blocks of 16)
    over three bfloat16 layers of 56 rows (of ``batch`` sequences)."""
    from kvstore.caches import KVCache
    from kvstore.store.kv import save as save_module
    from kvstore.store.kv.writer import HandedOff

    caches = []
    for layer in range(3):
        cache = KVCache()
        shape = (batch, 2, 56, 64)
        rows = mx.random.normal(shape, key=mx.random.key(layer)).astype(mx.bfloat16)
        cache.update_and_fetch(rows, rows * 2)
        caches.append(cache)
    if encoder_kind == "save":
        return save_module.BlockEncoder(caches, policy, {}, 56)
    return HandedOff(caches, policy, {}, (0, 56), 16)


@pytest.mark.parametrize("mode", ["stacked", "auto"])
@pytest.mark.parametrize("encoder_kind", ["save", "handed off"])
@pytest.mark.parametrize("policy", ["lossless", "kv:quant:8:64"])
def test_a_gpu_saves_blocks_cut_alike_get_stacked_payloads_and_encode_records_bytes(
    staged, monkeypatch, encoder_kind, policy, mode
):
    """KVSTORE_CUDA_SAVE_PAYLOADS=stacked: on a GPU a save's blocks cut from the same
    whole ranges get their payloads a run at a time (kvstore.codecs.stacked_payloads):
    the records are encode_record's. Under ``auto`` only the runs one copy builds
    (lossless keys and values; not a quantized layout's pieces of several shapes)."""
    from kvstore.abc.store import BlockSpan, PendingRecord
    from kvstore.store.kv import save as save_module

    encoder = _three_layer_encoder(encoder_kind, policy)
    stacked: list[list] = []
    real = save_module.stacked_payloads

    def spied(plans, cut_of, **kw):
        stacked.append(real(plans, cut_of, **kw))
        return stacked[-1]

    monkeypatch.setattr(save_module, "stacked_payloads", spied)
    monkeypatch.setattr(save_module, "SAVE_PAYLOADS", mode)
    spans = [BlockSpan(i, a, min(56, a + 16), b"") for i, a in enumerate(range(0, 56, 16))]
    records = encoder(spans)
    got = [bytes(r.result() if isinstance(r, PendingRecord) else r) for r in records]
    assert got == [encode_record(encoder.layers(s.start, s.stop)) for s in spans]
    if encoder_kind == "save" and policy != "lossless":
        # A policy's encoding block by block (a save encodes no stored rows): no cuts.
        assert stacked == []
    elif mode == "auto" and policy != "lossless":  # quantized pieces: two copies
        assert [p is None for p in stacked[0]] == [True] * 4
    else:  # three blocks of 16 rows in one run; the 8-row tail on its own
        assert [p is None for p in stacked[0]] == [False, False, False, True]


@pytest.mark.parametrize("case", ["record", "auto, a save over AUTO_STACKED_BYTES", "auto"])
def test_a_gpu_save_stacks_unless_record_or_too_large_under_auto(staged, monkeypatch, case):
    """Under ``record`` each record's payload is built on its own; under ``auto`` (the
    default) too where the save's payloads pass AUTO_STACKED_BYTES (a 2 GiB save stacked
    stalled a decode step beside it on an H100); else a lossless save stacks."""
    from kvstore.abc.store import BlockSpan, PendingRecord
    from kvstore.caches import KVCache
    from kvstore.store.kv import save as save_module

    assert save_module.SAVE_PAYLOADS == "auto"  # the default
    if case == "record":
        monkeypatch.setattr(save_module, "SAVE_PAYLOADS", "record")
    elif case != "auto":  # three records of 8 KiB
        monkeypatch.setattr(save_module, "AUTO_STACKED_BYTES", 3 * 8192 - 1)
    called = []
    real = save_module.stacked_payloads
    monkeypatch.setattr(
        save_module,
        "stacked_payloads",
        lambda *a, **kw: called.append(real(*a, **kw)) or called[-1],
    )
    cache = KVCache()
    rows = mx.random.normal((1, 2, 48, 64)).astype(mx.bfloat16)
    cache.update_and_fetch(rows, rows)
    encoder = save_module.BlockEncoder([cache], "lossless", {}, 48)
    spans = [BlockSpan(i, a, a + 16, b"") for i, a in enumerate(range(0, 48, 16))]
    records = encoder(spans)
    assert encoder._cuts == {}  # the cut pieces are not held past the call
    got = [bytes(r.result() if isinstance(r, PendingRecord) else r) for r in records]
    assert got == [encode_record(encoder.layers(s.start, s.stop)) for s in spans]
    if case == "auto":
        assert [p is None for p in called[0]] == [False] * 3
    else:
        assert called == []


def test_a_refused_copy_fails_that_save_alone_and_later_saves_take_the_kernel(
    tmp_path, staged, monkeypatch, caplog
):
    monkeypatch.setattr(cuda, "DOWNLOAD_ROUTE", "copy")
    staged.refuse_copies = True
    caches = _large_caches()
    tokens = list(range(1, 1101))
    with open_store(f"lmdb://{tmp_path / 's'}", block_size=256) as store:
        with caplog.at_level("WARNING", logger="kvstore.cuda"):
            with pytest.raises(RuntimeError, match="cuMemcpyDtoHAsync failed"):
                store.save("ns", tokens, caches)
        assert store.lookup("ns", tokens).tokens == 0  # nothing of it stored
        assert cuda.DOWNLOAD_ROUTE == "kernel"
        assert "saves use the kernel" in caplog.text
        downloads = staged.downloads
        store.save("ns", tokens, caches)
        assert staged.downloads > downloads and store.lookup("ns", tokens).tokens == 1099


def test_a_refused_address_kernel_downloads_that_save_by_the_kernel(staged, monkeypatch):
    from kvstore.abc.store import PendingRecord

    monkeypatch.setattr(cuda, "DOWNLOAD_ROUTE", "copy")
    staged.refuse_addresses = True
    layers = _large_layers()
    records = write_records([plan_record(layer) for layer in layers], pending=True)
    got = [bytes(r.result() if isinstance(r, PendingRecord) else r) for r in records]
    assert got == [encode_record(layer) for layer in layers]
    assert cuda.DOWNLOAD_ROUTE == "kernel" and staged.copied_on == []


def _large_caches():
    from kvstore.caches import KVCache

    caches = []
    for layer in range(3):
        cache = KVCache()
        rows = mx.random.normal((1, 8, 1100, 128), key=mx.random.key(layer)).astype(mx.bfloat16)
        cache.update_and_fetch(rows, rows * 2)  # 13 MiB in all: the pool's route
        caches.append(cache)
    return caches
