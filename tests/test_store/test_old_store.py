"""A store an earlier kvstore wrote opens, looks up and restores unchanged.

``tests/fixtures/stores/lmdb-fd945d7/`` is an LMDB store written by the kvstore of
``fd945d7`` (``tools/write_store_fixture.py``), before large values went to a file beside
LMDB: settings format 2, every value in LMDB's pages. This checkout reads it bit for
bit, keeps it as it is (new saves stay in LMDB's pages, the settings stay format 2, so
the kvstore that wrote it still opens it), and ``kvstore migrate`` copies it into a store
of today's layout.
"""

from __future__ import annotations

import lzma
from pathlib import Path

import lmdb
import mlx.core as mx
import pytest

from kvstore.caches import KVCache
from kvstore.cli import main
from kvstore.store import keys as K
from kvstore.store import open_store
from kvstore.store.engines.lmdb_values import FILE_NAME, Pointer
from tools.write_store_fixture import (
    BLOCK_SIZE,
    LAYERS,
    NAMESPACE,
    PROMPT_A,
    PROMPT_B,
    fixture_caches,
)

from .test_value_file import meta_format

FIXTURE = Path(__file__).parent.parent / "fixtures" / "stores" / "lmdb-fd945d7"


#: Values of 4 KiB or more go to a new store's file (conftest ``small_values``): the
#: fixture's ~128 KiB records would, so keeping them in LMDB's pages is this store's
#: layout, not their size.
pytestmark = pytest.mark.usefixtures("small_values")


@pytest.fixture
def old_store(tmp_path) -> Path:
    """A copy of the fixture (LMDB writes its lock file, and a test may save into it)."""
    path = tmp_path / "old"
    path.mkdir()
    (path / "data.mdb").write_bytes(lzma.decompress((FIXTURE / "data.mdb.xz").read_bytes()))
    return path


def raw_values(path: Path) -> dict[bytes, bytes]:
    env = lmdb.open(str(path), readonly=True, lock=False)
    try:
        with env.begin() as txn:
            return {bytes(k): bytes(v) for k, v in txn.cursor()}
    finally:
        env.close()


def restored(store, tokens: list[int]) -> list:
    """``tokens``' caches restored from ``store`` into fresh plain caches."""
    match = store.lookup(NAMESPACE, [*tokens, 0])  # one token left for the model
    assert match.tokens == len(tokens)
    return store.restore(match, [KVCache() for _ in LAYERS])


def assert_holds(caches: list, tokens: list[int]) -> None:
    """``caches`` hold exactly the rows the fixture saved for ``tokens``."""
    expected = fixture_caches(tokens)
    assert [c.offset for c in caches] == [len(tokens)] * len(expected)
    for got, want in zip(caches, expected, strict=True):
        for a, b in ((got.keys, want.keys), (got.values, want.values)):
            a, b = a[..., : len(tokens), :], b[..., : len(tokens), :]
            assert a.dtype == b.dtype and a.shape == b.shape
            assert mx.array_equal(a, b).item()


def test_the_fixture_is_the_layout_before_the_value_file(old_store):
    values = raw_values(old_store)
    assert meta_format(old_store) == 2
    assert not any(Pointer.looks_like(v) for v in values.values())
    assert not (old_store / FILE_NAME).exists()


def test_an_old_store_restores_bit_for_bit_and_verifies_clean(old_store):
    with open_store(f"lmdb://{old_store}") as store:
        assert store.settings.values == "inline"
        assert store.settings.block_size == BLOCK_SIZE
        for tokens in (PROMPT_A, PROMPT_B):
            assert_holds(restored(store, tokens), tokens)
        assert store.stats().blocks == 4  # A's three and B's own second (the first shared)
        assert store.verify().clean


def test_stats_say_where_its_large_values_are_and_how_to_move_them(old_store, capsys):
    def where() -> str:
        assert main(["stats", str(old_store)]) == 0
        out = capsys.readouterr().out.splitlines()
        return next(x for x in out if x.startswith("large values")).split(None, 2)[2]

    assert where() == (
        f"in LMDB's pages (this store's layout; `kvstore migrate {old_store} --in-place` "
        "moves values of 4.0 KiB or more to values.kv)"
    )
    assert main(["migrate", str(old_store), "--in-place", "--no-progress"]) == 0
    capsys.readouterr()
    assert where() == "4.0 KiB or more: in values.kv beside LMDB"


def test_saves_into_an_old_store_keep_its_layout(old_store):
    before = raw_values(old_store)
    new = list(range(3000, 3000 + 2 * BLOCK_SIZE))
    with open_store(f"lmdb://{old_store}") as store:
        store.save(NAMESPACE, new, fixture_caches(new))
        assert_holds(restored(store, new), new)
        assert_holds(restored(store, PROMPT_A), PROMPT_A)
    after = raw_values(old_store)
    assert not (old_store / FILE_NAME).exists() and meta_format(old_store) == 2
    assert not any(Pointer.looks_like(v) for v in after.values())
    # The old records are untouched, byte for byte.
    records = [k for k in before if K.split_record_key(k) is not None]
    assert records and all(after[k] == before[k] for k in records)


def test_migrate_copies_an_old_store_into_todays_layout(old_store, tmp_path, capsys):
    new = tmp_path / "new"
    assert main(["migrate", str(old_store), str(new), "--no-progress"]) == 0
    assert "nothing: records copied as they are (checked)" in capsys.readouterr().out
    assert meta_format(new) == 3 and (new / FILE_NAME).exists()
    assert any(Pointer.looks_like(v) for v in raw_values(new).values())
    with open_store(f"lmdb://{new}") as store:
        assert store.settings.values == "file"
        for tokens in (PROMPT_A, PROMPT_B):
            assert_holds(restored(store, tokens), tokens)
        assert store.verify().clean
    assert meta_format(old_store) == 2  # the source is left as it was


def test_migrate_in_place_moves_an_old_store_to_todays_layout(old_store, capsys):
    assert main(["migrate", str(old_store), "--in-place", "--no-progress"]) == 0
    capsys.readouterr()
    assert meta_format(old_store) == 3 and (old_store / FILE_NAME).exists()
    with open_store(f"lmdb://{old_store}") as store:
        assert store.settings.values == "file"
        for tokens in (PROMPT_A, PROMPT_B):
            assert_holds(restored(store, tokens), tokens)
        assert store.verify().clean
