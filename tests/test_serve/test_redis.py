"""``kvstore serve`` on Redis: the server stopped mid-run means misses, not failed requests."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvstore.testing.redis_servers import RedisServer, redis_binaries
from kvstore.testing.serve_processes import ServerProcess
from tests.markers import needs_tested_mlx_lm

from .conftest import chat, conversation

pytestmark = needs_tested_mlx_lm


def metric(server: ServerProcess, name: str, **labels: str) -> float:
    _, body = server.get("/metrics")
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return float(sample.value)
    raise AssertionError(f"no sample {name}{labels}")


def test_redis_stopped_mid_run_is_a_counted_miss_and_reuse_resumes(
    model_dir, server_env, logs, tmp_path
):
    if redis_binaries() is None:
        pytest.skip("redis-server is needed (apt-get install redis-server)")
    redis = RedisServer(tmp_path / "redis", appendonly=True).start()
    url = f"{redis.url}?socket_timeout=2&connect_timeout=1"
    # No in-memory prompt cache: every reuse here comes from the store.
    server = ServerProcess.kvstore(
        model_dir, url, "--prompt-cache-size", "0", log=logs / "redis.log", env=server_env
    )
    try:
        server.start()
        messages = conversation("Which module compresses files?")
        text, cached, prompt_tokens = chat(server, messages)
        assert cached == 0
        server.wait_saved()
        assert chat(server, messages) == (text, prompt_tokens - 1, prompt_tokens)

        redis.kill()
        other = chat(server, conversation("Which module hashes passwords?"))
        assert other[0] and other[1] == 0  # served, from nothing
        assert chat(server, messages) == (text, 0, prompt_tokens)
        server.wait_saved()
        assert metric(server, "kvstore_prompt_cache_misses_total", reason="unavailable") >= 2
        assert metric(server, "kvstore_save_errors_total", reason="unavailable") >= 1
        assert metric(server, "kvstore_store_up") == 0
        assert server.get("/health")[0] == 200
        stats = server.stats()
        assert stats["store"]["up"] is False and "Unavailable" in stats["store"]["error"]

        redis.start()  # the same port; its append-only file kept the blocks
        assert chat(server, messages) == (text, prompt_tokens - 1, prompt_tokens)
        assert metric(server, "kvstore_store_up") == 1
    finally:
        server.stop()
        redis.stop()
