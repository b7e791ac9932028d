"""open_store: URL forms, options, the meta record and settings precedence, capabilities."""

from __future__ import annotations

import struct

import msgpack
import pytest
import xxhash

from kvstore.errors import (
    CapabilityError,
    CorruptEntryError,
    FormatVersionError,
    ReadOnlyStoreError,
    StoreConfigError,
)
from kvstore.store import keys as K
from kvstore.store import open_backend, open_store
from kvstore.store.settings import META_FORMAT, StoreSettings, parse_byte_size
from kvstore.testing.store import encoder_for, verify_record


def test_url_forms(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for url, where in [
        (f"lmdb://{tmp_path}/a", tmp_path / "a"),
        (f"lmdb://localhost{tmp_path}/b", tmp_path / "b"),
        ("lmdb:rel/c", tmp_path / "rel" / "c"),
        ("lmdb:~/d", tmp_path / "home" / "d"),
        (str(tmp_path / "e"), tmp_path / "e"),
    ]:
        with open_store(url) as store:
            assert store.settings == StoreSettings(values="file")  # a new LMDB store
        assert (where / "data.mdb").is_file(), url


def test_memory_urls():
    with open_store("memory://") as a, open_store("memory://") as b:
        a.put_blocks("ns", [1, 2, 3], encoder_for([1, 2, 3]))
        assert not b.lookup("ns", [1, 2, 3]).hit  # private stores
    with open_store("memory://shared-x") as c, open_store("memory://shared-x") as d:
        c.put_blocks("ns", [1, 2, 3], encoder_for([1, 2, 3]))
        assert d.lookup("ns", [1, 2, 3]).tokens == 2


@pytest.mark.parametrize(
    "url, message",
    [
        ("", "non-empty string"),
        ("ftp://host/x", "Unknown store URL scheme 'ftp'.*Known schemes: lmdb, memory"),
        ("lmdb://somehost/var/kv", "three slashes"),
        ("lmdb://", "names no directory"),
    ],
)
def test_bad_urls(url, message):
    with pytest.raises(StoreConfigError, match=message):
        open_store(url)


def test_bad_options(tmp_path):
    with pytest.raises(StoreConfigError, match="Unknown option 'colour'.*block_size.*map_size"):
        open_store(f"lmdb://{tmp_path}/s", colour="red")
    with pytest.raises(StoreConfigError, match="given both in the URL and as an argument"):
        open_store(f"lmdb://{tmp_path}/s?block_size=8", block_size=8)
    with pytest.raises(StoreConfigError, match="block_size must be an integer in"):
        open_store("memory://", block_size=0)
    with pytest.raises(StoreConfigError, match="storage_policy"):
        open_store("memory://", storage_policy="kv:plain")
    with pytest.raises(StoreConfigError, match="Unknown option 'map_size' for 'memory://'"):
        open_backend("memory://", map_size=10)


def test_url_query_options(tmp_path):
    with open_store(f"lmdb://{tmp_path}/s?block_size=32&max_bytes=1MiB&sync=false") as store:
        assert store.block_size == 32 and store.settings.max_bytes == 1 << 20


def test_not_a_store(tmp_path):
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("x")
    with pytest.raises(StoreConfigError, match="non-empty directory with no LMDB store"):
        open_store(f"lmdb://{tmp_path}/busy")
    (tmp_path / "file").write_text("x")
    with pytest.raises(StoreConfigError, match="is a file"):
        open_store(f"lmdb://{tmp_path}/file")
    foreign = open_backend(f"lmdb://{tmp_path}/foreign")
    foreign.put_many([(b"somebody/else", b"1")])
    foreign.close()
    with pytest.raises(
        StoreConfigError, match="no kvstore/v1/__meta__ record: it is not a kvstore"
    ):
        open_store(f"lmdb://{tmp_path}/foreign")
    with pytest.raises(StoreConfigError, match="does not exist"):
        open_store(f"lmdb://{tmp_path}/missing", readonly=True)


def test_settings_precedence_and_conflicts(tmp_path):
    url = f"lmdb://{tmp_path}/s"
    with open_store(url, block_size=16, storage_policy="kv:quant:8:64") as store:
        assert store.settings.block_size == 16
    with open_store(url) as store:  # stored beats defaults
        assert store.settings.block_size == 16
        assert store.settings.storage_policy == "kv:quant:8:64"
    with pytest.raises(StoreConfigError) as info:
        open_store(url, block_size=256)
    err = info.value
    assert (err.setting, err.stored, err.requested) == ("block_size", 16, 256)
    assert "block_size was fixed when the store was created: stored 16, requested 256" in str(err)
    with pytest.raises(StoreConfigError, match="storage_policy was fixed"):
        open_store(url, storage_policy="lossless")
    with open_store(url, max_bytes="2GiB") as store:  # explicit beats stored, and is stored
        assert store.settings.max_bytes == 2 << 30
    with open_store(url) as store:
        assert store.settings.max_bytes == 2 << 30


def _framed(body: dict, version: int = 2) -> bytes:
    packed = msgpack.packb({**body, "format": version})
    fixed = struct.pack("<4sHHI", b"KVSM", version, 0, len(packed))
    return fixed + struct.pack("<Q", xxhash.xxh3_64_intdigest(fixed + packed)) + packed


def _body(url):
    raw = open_backend(url)
    try:
        record = raw.get_many([K.META_KEY])[0]
    finally:
        raw.close()
    return msgpack.unpackb(record[20:])


def test_meta_from_a_newer_writer_is_a_format_error(tmp_path):
    url = f"lmdb://{tmp_path}/s"
    open_store(url).close()
    body = _body(url)
    raw = open_backend(url)
    raw.put_many([(key, _framed(body, version=META_FORMAT + 1)) for key in K.META_KEYS])
    raw.close()
    with pytest.raises(FormatVersionError, match="newer than this reader") as info:
        open_store(url)
    assert info.value.found == META_FORMAT + 1


def test_a_format_1_meta_record_still_opens_and_is_upgraded(tmp_path):
    url = f"lmdb://{tmp_path}/s"
    open_store(url, block_size=16).close()
    legacy = msgpack.packb({**_body(url), "format": 1})
    raw = open_backend(url)
    raw.delete_many([K.META_COPY_KEY])
    raw.put_many([(K.META_KEY, legacy)])
    raw.close()
    with open_store(url, readonly=True) as store:  # read as it is
        assert store.settings.block_size == 16
        assert any("format 1" in p for p in store.verify().settings)
    with open_store(url) as store:  # a writable open rewrites both copies, checksummed
        assert store.settings.block_size == 16 and not store.verify().settings
    raw = open_backend(url)
    assert raw.get_many(list(K.META_KEYS)) == [raw.get_many([K.META_KEY])[0]] * 2
    assert raw.get_many([K.META_KEY])[0][:4] == b"KVSM"
    raw.close()


@pytest.mark.parametrize(
    "damage",
    ["unknown field", "flipped version", "flipped byte", "not msgpack", "truncated"],
)
def test_a_damaged_meta_record_says_run_verify_fix_not_upgrade(tmp_path, damage):
    url = f"lmdb://{tmp_path}/s"
    with open_store(url, block_size=16, verify=verify_record) as store:
        store.put_blocks("ns", list(range(40)), encoder_for(list(range(40))))
    body = _body(url)
    good = _framed(body)
    bad = {
        "unknown field": msgpack.packb({**body, "format": 1, "settings": {"colour": 1}}),
        "flipped version": good[:4] + bytes([good[4] ^ 1]) + good[5:],
        "flipped byte": good[:30] + bytes([good[30] ^ 8]) + good[31:],
        "not msgpack": b"\xc1\xc1\xc1",
        "truncated": good[:-3],
    }[damage]
    raw = open_backend(url)
    raw.put_many([(K.META_KEY, bad)])
    raw.close()
    with open_store(url, readonly=True, verify=verify_record) as store:  # the copy serves
        assert store.settings.block_size == 16
        assert store.verify().settings and not store.verify().clean
    raw = open_backend(url)
    raw.put_many([(K.META_COPY_KEY, bad)])  # now both copies are damaged
    raw.close()
    for options in ({}, {"readonly": True}):
        with pytest.raises(CorruptEntryError) as info:
            open_store(url, **options)
        message = str(info.value)
        assert "is damaged" in message and f"kvstore verify {url} --fix" in message
        assert "Upgrade" not in message
    with open_store(url, recover=True, verify=verify_record) as store:  # as verify --fix does
        report = store.verify(repair=True)
        assert report.settings and store.settings.block_size == 16  # rebuilt from the blocks
    with open_store(url, verify=verify_record) as store:
        assert store.settings.block_size == 16 and store.verify().clean
        assert store.lookup("ns", list(range(40))).tokens == 39


def test_read_only(tmp_path):
    url = f"lmdb://{tmp_path}/s"
    with open_store(url, block_size=4) as store:
        store.put_blocks("ns", [1, 2, 3, 4, 5], encoder_for([1, 2, 3, 4, 5]))
    with open_store(url, readonly=True) as store:
        assert store.read_only and store.lookup("ns", [1, 2, 3, 4, 5]).tokens == 4
        with pytest.raises(ReadOnlyStoreError, match="opened read-only"):
            store.put_blocks("ns", [9, 9], encoder_for([9, 9]))
        with pytest.raises(ReadOnlyStoreError):
            store.delete("ns")


def test_capabilities(tmp_path):
    with open_store(f"lmdb://{tmp_path}/s") as store:
        b = store.backend
        assert (b.supports_zero_copy, b.supports_multiprocess, b.supports_persistence) == (
            True,
            True,
            True,
        )
        with pytest.raises(CapabilityError, match=r"\[set_ttl\].*supports_ttl is False") as info:
            b.set_ttl([b"k"], 10)
        assert info.value.capability == "supports_ttl"
    with open_store("memory://") as store:
        assert not store.backend.supports_persistence and not store.backend.supports_ttl


@pytest.mark.parametrize(
    "text, value",
    [("1024", 1024), ("1KiB", 1024), ("1k", 1024), ("1KB", 1000), ("1.5GiB", 3 << 29), (7, 7)],
)
def test_byte_sizes(text, value):
    assert parse_byte_size(text) == value


@pytest.mark.parametrize("bad", ["-1", "1XB", "", 0, True, 1.5])
def test_bad_byte_sizes(bad):
    with pytest.raises(StoreConfigError):
        parse_byte_size(bad)
