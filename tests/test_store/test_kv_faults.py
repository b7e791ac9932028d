"""generate() with a store that fails: a real redis-server killed mid-restore (issue 8)."""

from __future__ import annotations

import logging
import threading

from kvstore.abc.store import MissReason
from kvstore.bridge import generate_tokens
from kvstore.store import open_store
from kvstore.testing.redis_servers import RedisServer

from .conftest import require_redis_server
from .kv_helpers import BLOCK, CHUNK, model_for, prompt


def test_generation_recomputes_when_the_server_dies_mid_restore_and_reuses_after(tmp_path, caplog):
    require_redis_server()
    model = model_for("tiny")
    tokens = prompt(30, 80)
    want, _ = generate_tokens(model, tokens, max_tokens=4, chunk_size=CHUNK, block_size=BLOCK)
    server = RedisServer(tmp_path / "redis", appendonly=True).start()
    try:
        options = {"block_size": BLOCK, "socket_timeout": 2, "connect_timeout": 0.5, "retries": 1}
        store = open_store(server.url, **options)
        generate_tokens(model, tokens, store=store, max_tokens=4, chunk_size=CHUNK)

        # The server hangs as the restore starts reading blocks, then dies.
        read = store.read_checking  # what a restore reads through

        def read_as_the_server_dies(blocks, **options):
            server.pause()
            threading.Timer(0.3, server.kill).start()
            return read(blocks, **options)

        store.read_checking = read_as_the_server_dies
        with caplog.at_level(logging.WARNING, "kvstore"):
            got, stats = generate_tokens(model, tokens, store=store, max_tokens=4, chunk_size=CHUNK)
        store.read_checking = read
        assert got == want  # recomputed from scratch
        assert stats.reused_tokens == 0
        assert stats.store_error.startswith("StoreUnavailableError")
        assert "restore failed, recomputing" in caplog.text
        assert "saving the prompt failed" in caplog.text  # the server is still down
        assert store.activity()["misses"][MissReason.UNAVAILABLE] >= 1

        server.start()  # same port; the blocks come back from the append-only file
        again, stats = generate_tokens(model, tokens, store=store, max_tokens=4, chunk_size=CHUNK)
        assert again == want
        # All but the last prompt token, which the model always processes itself.
        assert stats.reused_tokens == len(tokens) - 1 and stats.store_error is None
        store.close()
    finally:
        server.stop()
