"""The LMDB backend: every lmdb error mapped, the map growing by itself, a full disk."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import lmdb
import pytest

from kvstore.errors import KVStoreError, StoreError, StoreFullError, StoreUnavailableError
from kvstore.store.engines.boundary import translate_errors
from kvstore.store.engines.lmdb import LMDB_ERRORS
from kvstore.store.engines.lmdb_values import reader_slots
from kvstore.testing.store import check_match

from .store_worker import NS, open_, prompt, save

ROOT = Path(__file__).resolve().parents[2]


def run_worker(*args, **kw):
    return subprocess.run(
        [sys.executable, "-m", "tests.test_store.store_worker", *map(str, args)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        **kw,
    )


def lmdb_error_classes():
    found, todo = set(), [lmdb.Error]
    while todo:
        cls = todo.pop()
        found.add(cls)
        todo += cls.__subclasses__()
    found |= {v for v in vars(lmdb).values() if isinstance(v, type) and issubclass(v, lmdb.Error)}
    return found


def test_every_lmdb_error_is_mapped():
    classes = lmdb_error_classes()
    assert len(classes) >= 30  # python-lmdb 3.0 defines 30
    missing = sorted(c.__name__ for c in classes - set(LMDB_ERRORS))
    assert not missing, f"unmapped lmdb errors: {missing}"
    assert all(issubclass(t.error, KVStoreError) and t.hint for t in LMDB_ERRORS.values())


@pytest.mark.parametrize(
    "cls, ours",
    [
        (lmdb.MapFullError, StoreFullError),
        (lmdb.DiskError, StoreFullError),
        (lmdb.ReadersFullError, StoreUnavailableError),
        (lmdb.CorruptedError, StoreError),
    ],
)
def test_errors_are_translated_at_the_boundary(cls, ours):
    with pytest.raises(ours, match=r"^\[write\] .* from the store at lmdb:///x") as info:
        with translate_errors(LMDB_ERRORS, "write", "lmdb:///x"):
            raise cls("mdb_put", 0)
    assert isinstance(info.value.__cause__, cls)
    assert info.value.cause == cls.__name__


@pytest.mark.parametrize(
    "raised, expected", [(lmdb.BadTxnError, StoreError), (ValueError, ValueError)]
)
def test_a_read_views_errors_are_ours_and_its_gate_is_released(tmp_path, raised, expected):
    store = open_(tmp_path / "s")
    backend = store.backend
    with pytest.raises(expected) as info:
        with backend.reader():
            raise raised("mdb_get")
    if expected is StoreError:  # an engine error, translated; anything else as it was
        assert str(info.value).startswith("[read] BadTxnError from the store at lmdb://")
        assert isinstance(info.value.__cause__, lmdb.BadTxnError)
    with pytest.raises(StoreUnavailableError, match="busy"):  # ours pass through untouched
        with backend.reader():
            raise StoreUnavailableError("busy")
    with backend._gate.exclusive("write"):  # no read view is left holding the gate
        pass
    with backend.reader() as view:
        assert view.get(b"absent") is None
    store.close()


def test_the_map_grows_as_needed(tmp_path):
    # Values in LMDB's pages (a value file would take the 3 MiB records instead).
    store = open_(tmp_path / "s", map_size=1 << 20, values="inline")
    tokens = list(range(64))
    save(store, tokens, filler=3 << 20)  # 4 blocks of 3 MiB into a 1 MiB map
    assert store.backend.stats()["map_size"] > 12 << 20
    check_match(store, store.lookup(NS, tokens), tokens)
    store.close()


def test_a_full_map_raises_and_leaves_the_store_intact(tmp_path):
    store = open_(tmp_path / "s", map_size=1 << 20, max_map_size=8 << 20, values="inline")
    kept = prompt(1, 0)
    save(store, kept, filler=100_000)
    before = store.stats()
    with pytest.raises(StoreFullError, match="full at max_map_size"):
        save(store, list(range(64)), filler=4 << 20)
    after = store.stats()
    assert (after.blocks, after.bytes) == (before.blocks, before.bytes)
    assert store.verify().clean
    check_match(store, store.lookup(NS, kept), kept)
    save(store, prompt(1, 1))  # small saves still fit
    store.close()


def test_a_map_grown_by_another_process_is_adopted(tmp_path):
    path = tmp_path / "s"
    store = open_(path, map_size=1 << 20)
    save(store, prompt(2, 0))
    out = run_worker("grow", path, 8)
    assert out.returncode == 0, out.stderr
    check_match(store, store.lookup(NS, list(range(48)) + [0]), list(range(48)))
    save(store, prompt(2, 1), filler=1 << 20)  # writes still work at the new size
    assert store.verify().clean
    store.close()


@pytest.mark.parametrize("values", ["inline", "file"])
def test_a_full_disk_raises_store_full_and_leaves_the_store_intact(tmp_path, values):
    # A 12 MiB tmpfs in a private mount namespace (no root needed where user
    # namespaces are enabled); the worker saves until the disk is full.
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1) to mount a small tmpfs")
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True)
    if probe.returncode:
        pytest.skip(f"user+mount namespaces unavailable: {probe.stderr.decode().strip()}")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    script = (
        f"mount -t tmpfs -o size=12m tmpfs {mnt} && exec {sys.executable} "
        f"-m tests.test_store.store_worker fill {mnt}/store {values}"
    )
    out = subprocess.run(
        ["unshare", "-rm", "sh", "-c", script],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.split("\n")
    assert lines[0].startswith("FULL "), out.stdout  # DiskError, or EIO on a short write
    assert int(lines[0].split()[2]) >= 3 and "OK" in lines


def test_the_guard_reads_a_cursor_key_s_address_in_place(tmp_path):
    # The node check reads each key's address; through numpy that cost ~20x a get, so
    # a memoryview's buffer pointer is read in place, checked here against numpy.
    import lmdb

    from kvstore.store.engines import lmdb_guard

    assert lmdb_guard._BUF_OFFSET is not None  # this CPython: the fast path is on
    env = lmdb.open(str(tmp_path / "env"))
    with env.begin(write=True) as txn:
        for i in range(50):
            txn.put(b"key-%03d" % i, bytes(i))
    with env.begin(buffers=True) as txn:
        for key, _ in txn.cursor():
            assert type(key) is memoryview
            assert lmdb_guard.address_of(key) == lmdb_guard._numpy_address(key)
    env.close()


VALUES = {
    b"inline": b"i" * 100,
    b"one-page": bytes(range(256)) * 16,
    b"big": b"\x5a" * (3 << 20) + b"tail",
}


def lmdb_s_own_addresses(backend, keys):
    from kvstore.store.engines.lmdb_guard import address_of

    with backend._env.begin(buffers=True) as txn:
        return [address_of(txn.get(key)) for key in keys]


def test_an_overflow_value_is_viewed_where_lmdb_finds_it(tmp_path):
    # python-lmdb touches every page of a value before handing it out (16 records of
    # 32 MiB: ~4 ms on the restoring thread); a read transaction's overflow values are
    # viewed where LMDB's layout puts them instead, once two values read through
    # python-lmdb have said where the map lies: the same bytes at the same place.
    from kvstore.store.engines.lmdb import LMDBBackend
    from kvstore.store.engines.lmdb_guard import address_of

    backend = LMDBBackend(tmp_path / "s")
    backend.put_many(VALUES.items())
    big = [b"one-page", b"big"]
    with backend.view_many(big) as views:  # the map's address learned, then confirmed
        assert [bytes(v) for v in views] == [VALUES[k] for k in big]
    assert backend._shared.map_base and backend._shared.map_unconfirmed is None
    with backend.view_many(list(VALUES)) as views:
        got = dict(zip(VALUES, views, strict=True))
        assert {k: bytes(v) for k, v in got.items()} == VALUES
        assert all(type(got[k]) is memoryview and got[k].readonly for k in big)
        assert [address_of(got[k]) for k in big] == lmdb_s_own_addresses(backend, big)
    backend.close()


def test_a_map_that_moves_is_learned_again(tmp_path):
    # Growing the map remaps it, maybe elsewhere: where it lies is learned anew.
    from kvstore.store.engines.lmdb import LMDBBackend
    from kvstore.store.engines.lmdb_guard import address_of

    backend = LMDBBackend(tmp_path / "s", map_size=1 << 20)
    backend.put_many(VALUES.items())  # 3 MiB into a 1 MiB map: grown
    for _ in range(2):
        with backend.view_many([b"one-page", b"big"]):
            pass
    assert backend._shared.map_base
    more = {b"more-%d" % i: bytes([i]) * (32 << 20) for i in range(3)}
    backend.put_many(more.items())  # grown again
    assert backend._shared.map_base is None
    keys = [b"one-page", b"big", *more]
    for _ in range(2):
        with backend.view_many(keys) as views:
            assert [bytes(v) for v in views] == [{**VALUES, **more}[k] for k in keys]
            addresses = [address_of(v) for v in views]
    assert addresses == lmdb_s_own_addresses(backend, keys)
    backend.close()


def test_values_that_do_not_lie_where_the_layout_says_are_read_through_lmdb(tmp_path, monkeypatch):
    # Were LMDB's layout ever not what the guard reads (another LMDB), the second value
    # read gives the map another address than the first: no value is viewed without
    # python-lmdb from then on.
    from kvstore.store.engines.lmdb import LMDBBackend
    from kvstore.store.engines.lmdb_guard import NodeGuard

    original = NodeGuard.value_span

    def twice_as_far(self, key, end, *, mapped):
        span = original(self, key, end, mapped=mapped)
        return span if span is None or span[0] < 0 else (2 * span[0], span[1])

    monkeypatch.setattr(NodeGuard, "value_span", twice_as_far)
    backend = LMDBBackend(tmp_path / "s")
    backend.put_many(VALUES.items())
    for _ in range(3):
        with backend.view_many(list(VALUES)) as views:
            assert [bytes(v) for v in views] == list(VALUES.values())
    assert backend._shared.map_base == 0
    backend.close()


def test_a_store_the_parent_opened_refuses_a_forked_child_which_opens_its_own(tmp_path):
    # LMDB's environment, locks and reader slots are the opening process's: a forked
    # child gets a clear error from the inherited store, and its own open works.
    import os
    import warnings

    from kvstore.store import open_backend

    url = f"lmdb://{tmp_path / 'store'}"
    backend = open_backend(url)
    backend.transact(lambda txn: txn.put(b"parent", b"1"))
    with warnings.catch_warnings():  # Python 3.12+: forking a process with threads warns
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:
        code = 1
        try:
            try:
                with backend.reader() as view:
                    view.get(b"parent")
            except StoreUnavailableError as exc:
                refused = "fork" in str(exc) and exc.opened_in == os.getppid()
            else:
                refused = False
            own = open_backend(url)
            with own.reader() as view:
                seen = bytes(view.get(b"parent") or b"")
            own.transact(lambda txn: txn.put(b"child", b"2"))
            own.close()
            backend.close()  # the parent's: left to the parent
            code = 0 if refused and seen == b"1" else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    with backend.reader() as view:  # the parent's store is as it was, the child's write in
        assert bytes(view.get(b"parent")) == b"1" and bytes(view.get(b"child")) == b"2"
    backend.close()


@contextmanager
def killed_reader(store, path: Path) -> Iterator[None]:
    """A process inside a read transaction of the store at ``path`` for the block, then
    SIGKILLed: its slot stays in LMDB's reader table, holding its snapshot."""
    script = (
        "import lmdb, sys, time\n"
        "env = lmdb.open(sys.argv[1], readonly=True, max_dbs=0)\n"
        "txn = env.begin()\n"
        "print('reading', flush=True)\n"
        "time.sleep(60)\n"
    )
    with subprocess.Popen(
        [sys.executable, "-c", script, str(path)], stdout=subprocess.PIPE, text=True
    ) as reader:
        try:
            assert reader.stdout is not None and reader.stdout.readline() == "reading\n"
            slots = reader_slots(store.backend._shared.env.readers())
            assert reader.pid in {pid for pid, _ in slots}
            yield
        finally:
            reader.kill()


def test_pages_a_reader_killed_inside_its_snapshot_pinned_are_reused(tmp_path):
    # LMDB reuses a page freed after the oldest open snapshot only; a SIGKILLed reader's
    # slot would pin it until the store is next opened. A writer clears such slots.
    path = tmp_path / "s"
    with open_(str(path), values="inline") as store:
        prompts = [prompt(5, i) for i in range(3)]
        for tokens in prompts:
            save(store, tokens, filler=16384)
        with killed_reader(store, path):
            pass
        sizes = []
        for round_ in range(1, 9):
            store.delete(NS)
            for tokens in prompts:
                save(store, [t + round_ for t in tokens], filler=16384)
            sizes.append((path / "data.mdb").stat().st_size)
        assert sizes[-1] == sizes[len(sizes) // 2], sizes  # no longer growing (it had each round)
        for tokens in prompts:
            new = [t + 8 for t in tokens]
            check_match(store, store.lookup(NS, new), new)
