"""The commands on a Redis store: migrate LMDB -> Redis -> LMDB, inspect it, refusals."""

from __future__ import annotations

import json

import pytest

from kvstore.cli import main
from kvstore.codecs import decode_record_to_mlx
from kvstore.testing.redis_servers import RedisServer, free_port

from ..test_store.conftest import require_redis_server
from .conftest import content

pytestmark = pytest.mark.redis


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    require_redis_server()
    with RedisServer(tmp_path_factory.mktemp("redis-cli")) as server:
        yield server.url


def test_migrate_into_redis_and_back(make_store, redis_url, tmp_path, capsys):
    src = make_store()
    remote = f"{redis_url}?key_prefix=cli-mig/"
    assert main(["migrate", str(src), remote, "--to", "kv:quant:8:64", "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["verify", remote, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["after"]["blocks"] == 11
    assert main(["stats", remote, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["by_family"].keys() == {"kv:quant:8:64"}
    back = tmp_path / "back"
    assert main(["migrate", remote, str(back), "--to", "kv:plain", "--no-progress"]) == 0
    capsys.readouterr()
    # LMDB -> Redis -> LMDB keeps every key, and the rows are the quant-8 rows, dequantised.
    assert content(back).keys() == content(src).keys()
    for key, raw in content(back).items():
        if b"/." not in key and b"__ns__" not in key:
            assert {s.signature for s in decode_record_to_mlx(raw).layers} == {"kv:plain"}
    assert main(["migrate", remote, "--in-place", "--to", "kv:quant:4:64"]) == 2
    assert "cannot be swapped atomically" in capsys.readouterr().err


def test_a_redis_store_that_is_missing_or_unreachable(redis_url, capsys):
    assert main(["ls", f"{redis_url}?key_prefix=nothing-here/"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is empty: no store to open read-only" in err
    assert main(["ls", f"redis://127.0.0.1:{free_port()}/0?connect_timeout=0.5&retries=0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
