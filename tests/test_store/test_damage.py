"""Damaged stores (issue 18): every kind of damage is a counted miss or a clear,
repairable error -- never a crash, a dead store or a silent cut.

Each test plants one kind of damage in a real LMDB store of real records (through
the raw backend, or by editing ``data.mdb``'s bytes) and shows: a counted miss or a
``KVStoreError`` whose message says what to do; ``kvstore verify`` reports it;
``kvstore verify --fix`` repairs it; after a re-save the prompt is reused whole,
bit for bit. A SIGSTOPped redis-server (the sixth kind, a hung server) is in
``test_redis.py``: ``test_a_hung_server_is_unavailable_at_the_documented_deadline``.
"""

from __future__ import annotations

import copy
import json
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import msgpack
import pytest
import xxhash

from kvstore.abc.store import MissReason
from kvstore.bridge import generate_tokens
from kvstore.bridge.namespace import namespace_for_model
from kvstore.cli import main
from kvstore.codecs.record import read_header
from kvstore.errors import CorruptEntryError, KVStoreError, StoreError
from kvstore.store import keys as K
from kvstore.store import open_backend, open_store
from kvstore.testing.lmdb_pages import find_leaf_node, flip_bit, leaf_nodes, read_pages

from .kv_helpers import BLOCK, CHUNK, assert_same_caches, model_for, prefilled, prompt

TOKENS = prompt(11, 70)  # 4 full blocks and a tail of 6


@pytest.fixture
def url(tmp_path):
    url = f"lmdb://{tmp_path / 'store'}"
    with open_store(url, block_size=BLOCK, touch_interval=0) as store:
        save(store)
    return url


@pytest.fixture
def path(url):
    return url[len("lmdb://") :]


def model():
    return model_for("tiny")


def save(store):
    generate_tokens(model(), TOKENS, store=store, max_tokens=1, chunk_size=CHUNK)


def ns():
    return namespace_for_model(model())


def record_keys(url):
    with open_store(url, readonly=True, touch_interval=0) as store:
        match = store.lookup(ns(), [*TOKENS, 1])
    return [ref.key for ref in match.blocks]


def restore(store):
    match = store.lookup(ns(), [*TOKENS, 1])
    return store.restore(match, model().make_cache())


def assert_fully_reusable(url):
    """After a re-save, the whole prompt restores, bit for bit the model's own prefill."""
    with open_store(url, touch_interval=0) as store:
        save(store)
        caches = restore(store)
        assert caches[0].offset == len(TOKENS)
    assert_same_caches(caches, prefilled(model(), TOKENS))


def assert_fix_rebuilds_the_file(capsys, url, path):
    """``verify --fix`` rebuilds the damaged file; the store is then clean and, after a
    re-save, fully reusable."""
    status, out, _ = run_cli(capsys, "verify", path, "--fix")
    assert status == 0 and "rebuilt the damaged file" in out
    status, report = verify_json(capsys, path)
    assert status == 0 and report["clean"]
    assert_fully_reusable(url)


def run_cli(capsys, *argv):
    status = main([*argv])
    out = capsys.readouterr()
    return status, out.out, out.err


def verify_json(capsys, path, *extra):
    status, out, err = run_cli(capsys, "verify", path, "--json", *extra)
    return status, json.loads(out)


def raw_put(url, key, value):
    backend = open_backend(url)
    try:
        backend.put_many([(key, value)])
    finally:
        backend.close()


def raw_get(url, key):
    backend = open_backend(url)
    try:
        return backend.get_many([key])[0]
    finally:
        backend.close()


def refreshed(record, change):
    """``record`` with its header changed by ``change`` and both checksums recomputed,
    as a buggy or hostile writer would."""
    length = struct.unpack_from("<I", record, 8)[0]
    header = msgpack.unpackb(record[20 : 20 + length])
    change(header)
    packed = msgpack.packb(header, use_bin_type=True)
    fixed = struct.pack("<4sHHI", b"KVST", 1, 0, len(packed))
    head = fixed + struct.pack("<Q", xxhash.xxh3_64_intdigest(fixed + packed)) + packed
    head += bytes(-len(head) % 64)
    payload_at = -(-(20 + length) // 64) * 64
    return head + record[payload_at:]


# ---------------------------------------------------------------- 1. bookkeeping


def test_totals_that_disagree_with_the_blocks_repair_themselves(url, path, capsys):
    # Issue 18, damage 1: close() raised AssertionError "namespace totals went negative"
    # and `kvstore gc` died with a traceback.
    totals = K.totals_key(ns().encode())
    first = record_keys(url)[1]
    raw_put(url, totals, struct.pack("<QQ", 1, 1000))  # an older, unchecked value
    raw_put(url, first, bytes(raw_get(url, first)[:-1]) + b"\x00")  # a corrupt payload
    with open_store(url, touch_interval=0) as store:
        caches = restore(store)
        assert caches[0].offset == BLOCK  # cut before the corrupt block, never served
        assert store.stats().misses[MissReason.CORRUPT] == 1
        store.flush()  # its removal takes the totals below zero: counted again instead
        assert store.stats().corruptions == 2  # the record, and the totals it repaired
    with open_store(url, readonly=True, touch_interval=0) as store:
        stats = store.stats()
        assert (stats.blocks, stats.bytes) == (1, store.verify().bytes)
        assert store.verify().clean
    raw_put(url, totals, struct.pack("<QQ", 1, 1000))
    status, out, err = run_cli(capsys, "gc", path, "--max-bytes", "1KB")
    assert status == 0 and not err  # evicts, counting the totals again; no traceback
    raw_put(url, totals, struct.pack("<QQ", 7, 7))
    status, report = verify_json(capsys, path)
    assert status == 1 and report["found"]["totals_mismatch"]
    status, report = verify_json(capsys, path, "--fix")
    assert status == 0 and report["clean"]
    assert_fully_reusable(url)


def test_a_totals_key_that_names_no_namespace_is_a_dangling_key(url, path, capsys):
    # Found by the sweep (--leaf-headers, bytes 739682 and 741016): a grown key size made
    # a totals key read with bytes of the node beside it, a name that is no namespace
    # (nor UTF-8), and stats() raised a foreign UnicodeDecodeError.
    good = K.totals_key(ns().encode())
    raw_put(url, good + b"\x80\xc0", raw_get(url, good))
    with open_store(url, touch_interval=0) as store:
        assert list(store.stats().namespaces) == [ns()]
    status, report = verify_json(capsys, path)
    assert status == 1 and len(report["found"]["dangling"]) == 1
    status, report = verify_json(capsys, path, "--fix")
    assert status == 0 and report["clean"]
    assert raw_get(url, good + b"\x80\xc0") is None
    assert_fully_reusable(url)


def test_damaged_totals_values_are_counted_from_the_blocks(url):
    totals = K.totals_key(ns().encode())
    good = raw_get(url, totals)
    assert len(good) == 24  # blocks, bytes, checksum
    raw_put(url, totals, good[:8] + bytes([good[8] ^ 0x80]) + good[9:])  # a flipped high bit
    with open_store(url, readonly=True, touch_interval=0) as store:
        assert store.stats().blocks == 5  # counted from the index, not the damaged value
        assert any("damaged" in m for m in store.verify().totals_mismatch)
    with open_store(url, touch_interval=0, max_bytes="1GB") as store:
        save(store)  # a budget check reads the totals: not 2**63 bytes, so nothing evicted
        assert store.stats().evictions == 0


# ---------------------------------------------------------------- 2. SIGBUS


READER = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {root!r})
    from tests.test_store.test_damage import model, ns, TOKENS
    from kvstore.store import open_backend, open_store
    url = {url!r}
    backend = open_backend(url)
    value = backend.get_many([bytes.fromhex({key!r})])[0]
    backend.close()
    with open_store(url, touch_interval=0) as store:
        match = store.lookup(ns(), [*TOKENS, 1])
        caches = store.restore(match, model().make_cache())
        print(len(value), caches[0].offset, store.stats().misses.get("corrupt", 0))
    """
)


@pytest.mark.parametrize("bit", [31, 30, 24, 17])
def test_a_flipped_overflow_size_is_a_corrupt_miss_not_sigbus(url, path, capsys, bit):
    # Issue 18, damage 2: one flipped high bit in an overflow node's data size made
    # python-lmdb fault in pages past the end of data.mdb (SIGBUS, no traceback).
    key = record_keys(url)[2]
    node = find_leaf_node(f"{path}/data.mdb", key)
    assert node.overflow_pgno is not None
    flip_bit(f"{path}/data.mdb", node.offset + bit // 8, bit % 8)
    assert find_leaf_node(f"{path}/data.mdb", key).size == node.size ^ (1 << bit)
    status, report = verify_json(capsys, path)  # (its scan runs in a child process)
    assert status == 1 and "cannot hold" in report["found"]["engine"][0]
    code = READER.format(root=str(_root()), url=url, key=key.hex())
    reader = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert reader.returncode == 0, reader.stderr[-2000:]  # no signal
    length, offset, corrupt = map(int, reader.stdout.split())
    assert length != node.size and offset == 2 * BLOCK and corrupt == 1
    status, report = verify_json(capsys, path, "--fix")
    assert status == 0 and report["clean"]
    assert_fully_reusable(url)


def test_a_damaged_branch_page_is_found_and_the_file_rebuilt(url, path, capsys):
    # Damage LMDB itself follows (a branch pointer) is found by verify's own reading of
    # the file, and --fix rebuilds the file from every key that reads intact.
    with open_store(url, touch_interval=0) as store:  # enough keys for a branch page
        for seed in range(12):
            generate_tokens(model(), prompt(100 + seed, 40), store=store, max_tokens=1)
    _, pages = read_pages(f"{path}/data.mdb")
    branch = next(p for p in pages if p.kind == "branch")
    data = Path(path, "data.mdb").read_bytes()
    lower = struct.unpack_from("<H", data, branch.offset + 12)[0]
    last = struct.unpack_from("<H", data, branch.offset + lower - 2)[0]  # the last child
    flip_bit(f"{path}/data.mdb", branch.offset + last, 0)  # its page number, off by one
    status, report = verify_json(capsys, path)
    assert status == 1 and report["found"]["engine"]
    assert_fix_rebuilds_the_file(capsys, url, path)


def test_a_value_size_grown_into_the_next_node_is_found_and_the_file_rebuilt(url, path, capsys):
    # Found by the sweep (leaf 312856 bit 6): a flipped size bit made the value at the
    # bottom of a leaf page (its lowest node, at ``upper``: there an index entry, here
    # the namespace totals) run 64 bytes into the node above it. LMDB reads it (a wrong
    # value: orphans, dangling keys, totals); verify --fix rewriting it in place, which
    # LMDB does by deleting the node at its stored size, raised the page's free-space
    # mark into the node above, and the next write overwrote that one: the store was
    # MDB_CORRUPTED ("Located page was wrong type") after --fix.
    data = f"{path}/data.mdb"
    psize = read_pages(data)[0]
    by_page: dict[int, list] = {}
    for n in leaf_nodes(data):
        by_page.setdefault(n.offset // psize, []).append(n)
    node, above = next(
        (low, above)
        for nodes in by_page.values()
        for low, above in [sorted(nodes, key=lambda n: n.offset)[:2]]
        if low.overflow_pgno is None
        and not low.size & 0x40
        and low.offset + 8 + len(low.key) + low.size + 0x40 > above.offset
    )
    flip_bit(data, node.offset, 6)  # its size + 64
    status, report = verify_json(capsys, path)
    assert status == 1 and any("runs into" in p for p in report["found"]["engine"])
    assert_fix_rebuilds_the_file(capsys, url, path)


# ---------------------------------------------------------------- 3. settings


def test_damaged_settings_say_run_verify_fix_and_it_repairs_them(url, path, capsys):
    # Issue 18, damage 3: a flip in a field name made every entry point refuse the store
    # with "... does not know ... Upgrade kvstore", and verify --fix could not open it.
    record = raw_get(url, K.META_KEY)
    damaged = record[:-5] + bytes([record[-5] ^ 0x20]) + record[-4:]
    raw_put(url, K.META_KEY, damaged)
    with open_store(url, touch_interval=0) as store:  # the copy serves, and repairs it
        assert store.settings.block_size == BLOCK
    assert raw_get(url, K.META_KEY) == record
    for key in K.META_KEYS:
        raw_put(url, key, damaged)
    with pytest.raises(CorruptEntryError) as info:
        open_store(url)
    assert f"Run 'kvstore verify {url} --fix'" in str(info.value)
    assert "pgrade" not in str(info.value)
    status, out, err = run_cli(capsys, "ls", path)
    assert status == 2 and "kvstore verify" in err and len(err.strip().splitlines()) == 1
    status, report = verify_json(capsys, path)
    assert status == 1 and report["found"]["settings"]
    status, report = verify_json(capsys, path, "--fix")
    assert status == 0 and report["clean"]
    with open_store(url, readonly=True) as store:
        assert store.settings.block_size == BLOCK  # rebuilt from the blocks
    assert_fully_reusable(url)


def test_a_flipped_bit_in_the_settings_page_of_data_mdb(url, path, capsys):
    node = find_leaf_node(f"{path}/data.mdb", K.META_KEY)
    flip_bit(f"{path}/data.mdb", node.offset + 8 + len(K.META_KEY) + 30, 3)  # in its body
    with open_store(url, readonly=True) as store:
        assert store.settings.block_size == BLOCK and store.verify().settings
    status, report = verify_json(capsys, path, "--fix")
    assert status == 0 and report["clean"]
    assert_fully_reusable(url)


# ---------------------------------------------------------------- 4. version field


def test_a_flipped_record_version_is_corrupt_and_re_saved(url, path, capsys):
    # Issue 18, damage 4: the flip read as "a newer kvstore": kept, never served, counted
    # clean, and re-saves deduplicated against it, so the prompt stayed cut there.
    key = record_keys(url)[1]
    record = bytearray(raw_get(url, key))
    record[5] ^= 0x01  # format 1 -> 257
    raw_put(url, key, bytes(record))
    status, report = verify_json(capsys, path)
    assert status == 1 and report["found"]["corrupt"] == [key.decode()]
    assert not report["found"]["newer_format"]
    with open_store(url, touch_interval=0) as store:
        assert restore(store)[0].offset == BLOCK
        misses = store.stats().misses
        assert misses[MissReason.CORRUPT] == 1 and MissReason.VERSION not in misses
    status, report = verify_json(capsys, path, "--fix")
    assert status == 0 and report["clean"]
    assert_fully_reusable(url)  # the block is written again, not deduplicated against


def test_a_genuinely_newer_record_stays_newer(url, path, capsys):
    key = record_keys(url)[1]

    def newer(header):
        header["format"] = 2

    record = bytearray(refreshed(raw_get(url, key), newer))
    record[4:6] = struct.pack("<H", 2)
    fixed = bytes(record[:12])
    length = struct.unpack_from("<I", record, 8)[0]
    checksum = xxhash.xxh3_64_intdigest(fixed + bytes(record[20 : 20 + length]))
    record[12:20] = struct.pack("<Q", checksum)
    raw_put(url, key, bytes(record))
    with open_store(url, touch_interval=0) as store:
        assert restore(store)[0].offset == BLOCK
        assert store.stats().misses[MissReason.VERSION] == 1
    status, report = verify_json(capsys, path, "--fix")
    assert report["found"]["newer_format"] == [key.decode()]
    assert raw_get(url, key) == bytes(record)  # kept for the newer reader


# ---------------------------------------------------------------- 6. snapshot meta


@pytest.mark.parametrize(
    "field, value",
    [("max_size", 2**64 - 1), ("keep", 2**31), ("offset", "70"), ("offset", {}), ("dtype", "int8")],
)
def test_tampered_snapshot_meta_is_a_counted_miss(tmp_path, capsys, field, value):
    # Issue 18, damage 6: records whose checksums were recomputed after tampering were
    # accepted. Windowed layers carry max_size and keep, so this store is Gemma-like.
    url = f"lmdb://{tmp_path / 'store'}"
    gemma = model_for("tiny-gemma3")
    tokens = prompt(12, 30)
    with open_store(url, block_size=BLOCK, touch_interval=0) as store:
        generate_tokens(gemma, tokens, store=store, max_tokens=1, chunk_size=CHUNK)
        key = store.lookup(namespace_for_model(gemma), [*tokens, 1]).blocks[0].key

    def tamper(header):
        for layer in header["layers"]:
            if layer is not None and field in layer["meta"]:
                layer["meta"][field] = copy.copy(value)

    raw_put(url, key, refreshed(raw_get(url, key), tamper))
    ns_g = namespace_for_model(gemma)
    status, report = verify_json(capsys, str(tmp_path / "store"))
    assert status == 1 and report["found"]["corrupt"] == [key.decode()]
    with open_store(url, touch_interval=0) as store:
        match = store.lookup(ns_g, [*tokens, 1])
        caches = store.restore(match, gemma.make_cache())  # no exception escapes
        assert caches[0].offset == 0
        assert store.stats().misses[MissReason.CORRUPT] == 1
    status, report = verify_json(capsys, str(tmp_path / "store"), "--fix")
    assert status == 0 and report["clean"]
    tampered = refreshed(raw_get(url, key), tamper) if raw_get(url, key) else None
    assert tampered is None  # removed with everything stored after it
    with open_store(url, touch_interval=0) as store:
        generate_tokens(gemma, tokens, store=store, max_tokens=1, chunk_size=CHUNK)
        caches = store.restore(store.lookup(ns_g, [*tokens, 1]), gemma.make_cache())
    assert caches[0].offset == len(tokens)
    assert_same_caches(caches, prefilled(gemma, tokens))
    with pytest.raises(CorruptEntryError, match=field):
        read_header(refreshed(raw_get(url, key), tamper))  # the message names the field


def test_every_store_error_of_the_cli_is_one_line(url, path, capsys):
    for key in K.META_KEYS:
        raw_put(url, key, b"\x00")
    for argv in (["ls", path], ["stats", path], ["gc", path, "--max-bytes", "1KB"]):
        status, out, err = run_cli(capsys, *argv)
        assert status == 2 and len(err.strip().splitlines()) == 1, (argv, err)
        assert "verify" in err
    assert isinstance(_error(url), KVStoreError)


def _error(url):
    try:
        open_store(url)
    except KVStoreError as exc:
        return exc
    return None


def _root():
    return Path(__file__).resolve().parents[2]


def test_a_crash_of_verify_s_scan_is_reported_as_damage(url, path, capsys, tmp_path, monkeypatch):
    # A real child killed by a real SIGBUS: every Python started with this PYTHONPATH
    # signals itself as it starts (this process started long before).
    hook = tmp_path / "crashing"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import os, signal\nos.kill(os.getpid(), signal.SIGBUS)\n"
    )
    monkeypatch.setenv("PYTHONPATH", f"{hook}:{_root()}")
    status, out, err = run_cli(capsys, "verify", path)
    assert status == 2 and len(err.strip().splitlines()) == 1
    assert "crashed the scan (SIGBUS)" in err and "damaged" in err
    assert f"Run 'kvstore verify {path} --fix --rebuild'" in err
    monkeypatch.delenv("PYTHONPATH")
    status, out, _ = run_cli(capsys, "verify", path, "--fix", "--rebuild")  # as it says
    assert status == 0 and "rebuilt" in out


def test_rebuild_keeps_an_intact_store_whole(url, path, capsys):
    before = raw_items(url)
    status, out, _ = run_cli(capsys, "verify", path, "--fix", "--rebuild")
    assert status == 0 and f"kept {len(before)} keys" in out
    assert raw_items(url) == before
    with open_store(url, readonly=True) as store:
        assert restore(store)[0].offset == len(TOKENS)


def test_a_rebuild_leaves_behind_keys_lmdb_cannot_hold(path, tmp_path, monkeypatch):
    # A flipped key size in a leaf can make the salvaged key empty or longer than LMDB
    # allows (the sweep's MDB_BAD_VALSIZE from mdb_put): such a key is damage, not data.
    import lmdb

    import kvstore.store.maintenance.rebuild as rebuild

    real = rebuild.salvage
    intact = dict(real(Path(path)))

    def with_damaged_keys(store):
        yield b"", b"an empty key"
        yield b"kvstore/" + b"k" * 600, b"a key longer than LMDB's maximum"
        yield from real(store)

    monkeypatch.setattr(rebuild, "salvage", with_damaged_keys)
    keys, _ = rebuild._copy_into(Path(path), tmp_path / "fresh", 1 << 20)
    assert keys == len(intact)
    env = lmdb.open(str(tmp_path / "fresh"), readonly=True, subdir=True)
    try:
        with env.begin() as txn:
            assert dict(txn.cursor()) == intact
    finally:
        env.close()


def raw_items(url):
    backend = open_backend(url)
    try:
        return dict(backend.scan(b"kvstore/"))
    finally:
        backend.close()


# ---------------------------------------------------------------- written behind


def test_records_written_behind_get_every_check(tmp_path, capsys):
    # save_behind's records are built on the writer thread into an arena
    # (kvstore.codecs.arena.write_records): damaged or tampered, they are misses
    # like any other record, and verify --fix repairs them.
    url = f"lmdb://{tmp_path / 'store'}"
    with open_store(url, block_size=BLOCK, touch_interval=0, durability="group") as store:
        store.save_behind(ns(), TOKENS, prefilled(model(), TOKENS)).result()
    first, second = record_keys(url)[1:3]
    record = bytearray(raw_get(url, first))
    record[5] ^= 0x01  # a flipped format version: damage, not "newer"
    raw_put(url, first, bytes(record))

    def offset_as_text(header):
        for layer in header["layers"]:
            layer["meta"]["offset"] = str(layer["meta"]["offset"])

    raw_put(url, second, refreshed(raw_get(url, second), offset_as_text))
    status, report = verify_json(capsys, str(tmp_path / "store"))
    assert status == 1 and sorted(report["found"]["corrupt"]) == sorted(
        k.decode() for k in (first, second)
    )
    with open_store(url, touch_interval=0) as store:
        assert restore(store)[0].offset == BLOCK
        assert store.stats().misses[MissReason.CORRUPT] == 1
    status, report = verify_json(capsys, str(tmp_path / "store"), "--fix")
    assert status == 0 and report["clean"]
    with open_store(url, touch_interval=0) as store:
        store.save_behind(ns(), TOKENS, prefilled(model(), TOKENS))
        caches = restore(store)  # the lookup waits for the namespace's save
    assert caches[0].offset == len(TOKENS)
    assert_same_caches(caches, prefilled(model(), TOKENS))


@pytest.mark.parametrize("durability", ["group", "sync"])
def test_a_commit_written_behind_counts_damaged_totals_again(url, durability):
    # The writer thread's commit adds to damaged totals: they are counted again from
    # the blocks in that transaction and the repair counted, as on the caller's thread.
    totals = K.totals_key(ns().encode())
    good = raw_get(url, totals)
    raw_put(url, totals, good[:8] + bytes([good[8] ^ 0x80]) + good[9:])
    more = prompt(13, 40)
    with open_store(url, touch_interval=0, durability=durability) as store:
        store.save_behind(ns(), more, prefilled(model(), more)).result()
        assert store.stats().corruptions == 1
    with open_store(url, readonly=True, touch_interval=0) as store:
        report = store.verify()
        assert report.clean and store.stats().bytes == report.bytes


@pytest.mark.parametrize(
    "offset, bit, what, refused",
    [
        (16, 0, "magic", True),
        (20, 5, "version", True),
        (143, 1, "last page", True),
        (39, 6, "map size", False),  # the store's own map_size is used: it opens
    ],
)
def test_a_meta_page_lmdb_refuses_is_rebuilt(url, path, capsys, offset, bit, what, refused):
    # Found by the sweep: LMDB refuses to open a file whose meta page 0 is damaged
    # (MDB_INVALID, a version "not supported", ENOMEM, MAP_RESIZED), and the rebuild
    # opened it with LMDB for its lock: an lmdb.Error escaped verify --fix.
    flip_bit(f"{path}/data.mdb", offset, bit)
    if refused:
        with pytest.raises(KVStoreError):
            open_store(url)
    status, report = verify_json(capsys, path)
    assert status == 1, what
    assert any(p.startswith("meta page 0 is damaged") for p in report["found"]["engine"]), what
    status, report = verify_json(capsys, path, "--fix")
    assert status == 0 and report["clean"]
    assert_fully_reusable(url)


def newer_meta_page(path):
    """``(page size, slot)`` of the meta page LMDB opens the file with (the higher txnid)."""
    data = Path(path, "data.mdb").read_bytes()
    psize = read_pages(f"{path}/data.mdb")[0]
    return psize, max(
        (0, 1), key=lambda slot: struct.unpack_from("<Q", data, slot * psize + 144)[0]
    )


def test_a_flipped_tree_flag_in_the_meta_page_is_refused_and_the_file_rebuilt(url, path, capsys):
    # Found by the sweep (meta position 92 bit 1): a flip in the newer meta page's flags
    # of the main tree set MDB_REVERSEKEY; LMDB then compares keys from their ends and
    # finds none, so the store refused to open ("both copies are missing") and verify
    # --fix, reading the same page, could not repair it.
    psize, newer = newer_meta_page(path)
    flip_bit(f"{path}/data.mdb", newer * psize + 92, 1)  # the main tree's md_flags: 0x02
    with pytest.raises(StoreError, match=r"tree flags 0x8/0x2.*run 'kvstore verify .* --fix'"):
        open_store(url)
    status, report = verify_json(capsys, path)
    assert status == 1
    assert f"meta page {newer} is damaged: tree flags" in report["found"]["engine"][0]
    status, report = verify_json(capsys, path, "--fix")
    assert status == 0 and report["clean"]
    assert_fully_reusable(url)


def test_meta_damage_lmdb_copies_into_the_other_page_keeps_every_block(url, path, capsys):
    # Found by the sweep (meta bytes 37-39, 44-45, 92-93, 140 of the newer page): LMDB
    # takes a meta page's map size, flags and pad on trust and writes them into the
    # other meta page with its next commit. Then neither page read as intact, and
    # --fix rebuilt an empty store. Now the store refuses to open on such a page (no
    # commit spreads it), and where LMDB spread it anyway, the tree under it is kept.
    import lmdb

    psize, newer = newer_meta_page(path)
    flip_bit(f"{path}/data.mdb", newer * psize + 38, 0)  # the map size + 2**48
    with pytest.raises(StoreError, match=r"meta page \d is damaged: map size"):
        open_store(url)
    env = lmdb.open(path, subdir=True, max_dbs=0)  # LMDB itself: it opens, and commits
    with env.begin(write=True) as txn:
        txn.put(K.META_KEY, txn.get(K.META_KEY))
    env.close()
    data = Path(path, "data.mdb").read_bytes()
    sizes = {struct.unpack_from("<Q", data, slot * psize + 32)[0] for slot in (0, 1)}
    assert len(sizes) == 1 and sizes.pop() > 1 << 48  # both pages carry it now
    status, report = verify_json(capsys, path)
    assert status == 1 and len(report["found"]["engine"]) == 2
    status, report = verify_json(capsys, path, "--fix")
    assert status == 0 and report["clean"]
    with open_store(url, readonly=True, touch_interval=0) as store:
        assert restore(store)[0].offset == len(TOKENS)  # nothing lost: before any re-save
    assert_fully_reusable(url)


def test_a_rebuild_without_lmdb_refuses_while_another_process_has_the_store(url, path, capsys):
    # Another process has the store open through LMDB (it opened it intact); then meta
    # page 0 is damaged, so verify --fix cannot ask LMDB who else uses the store.
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, path], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        assert holder.stdout.readline().strip() == b"holding"
        flip_bit(f"{path}/data.mdb", 16, 0)  # meta page 0's magic: LMDB refuses the file
        status, out, err = run_cli(capsys, "verify", path, "--fix")
        assert status == 2 and "open in another process" in err
    finally:
        holder.communicate(b"\n")
    status, report = verify_json(capsys, path, "--fix")  # alone now
    assert status == 0 and report["clean"]


HOLDER = textwrap.dedent(
    """
    import sys
    import lmdb
    env = lmdb.open(sys.argv[1], create=False)
    print("holding", flush=True)
    sys.stdin.readline()
    env.close()
    """
)


def test_a_free_list_in_overflow_pages_is_intact(tmp_path):
    # Deleting many large values frees a page list too long for a leaf: LMDB stores it
    # in overflow pages (F_BIGDATA), which the file check once took for damage.
    from kvstore.store.engines.lmdb_file import check_file

    backend = open_backend(f"lmdb://{tmp_path / 'store'}")
    try:
        keys = [b"kvstore/v1/x/%05d" % i for i in range(400)]
        backend.put_many([(k, bytes(64 << 10)) for k in keys])

        def drop(txn):
            for k in keys:
                txn.delete(k)

        backend.transact(drop)
        backend.put_many([(b"kvstore/v1/y", b"1")])  # a commit after: the list is stored
    finally:
        backend.close()
    assert check_file(tmp_path / "store").problems == []
