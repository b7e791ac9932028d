"""open_store: URL forms, options, the meta record and settings precedence, capabilities."""

from __future__ import annotations

import msgpack
import pytest

from kvstore.errors import (
    CapabilityError,
    FormatVersionError,
    ReadOnlyStoreError,
    StoreConfigError,
)
from kvstore.store import keys as K
from kvstore.store import open_backend, open_store
from kvstore.store.settings import StoreSettings, parse_byte_size
from kvstore.testing.store import encoder_for


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
            assert store.settings == StoreSettings()
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


def test_meta_from_a_newer_or_unknown_writer(tmp_path):
    url = f"lmdb://{tmp_path}/s"
    open_store(url).close()
    raw = open_backend(url)
    meta = msgpack.unpackb(raw.get_many([K.META_KEY])[0])
    raw.put_many([(K.META_KEY, msgpack.packb({**meta, "format": 2}))])
    with pytest.raises(FormatVersionError, match="newer than this reader") as info:
        open_store(url)
    assert info.value.found == 2
    raw.put_many([(K.META_KEY, msgpack.packb({**meta, "settings": {"colour": 1}}))])
    with pytest.raises(StoreConfigError, match="does not know: colour"):
        open_store(url)
    raw.close()


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
