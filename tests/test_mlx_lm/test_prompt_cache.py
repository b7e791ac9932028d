"""StorePromptCache: restore -> stream_generate -> insert gives the tokens of no store."""

from __future__ import annotations

import threading

import pytest
from mlx_lm.generate import stream_generate as mlx_lm_stream_generate
from mlx_lm.models.cache import (
    KVCache,
    LRUPromptCache,
    RotatingKVCache,
    make_prompt_cache,
)

from kvstore.abc.store import MissReason
from kvstore.caches import QuantizedKVCache as OurQuantizedKVCache
from kvstore.mlx_lm import (
    IMAGE_PROMPT,
    NOT_PERSISTED,
    QUEUE_FULL,
    StorePromptCache,
    stream_generate,
)
from kvstore.mlx_lm.capture import CapturingRotatingKVCache
from kvstore.store import open_store
from tests.markers import needs_tested_mlx_lm

# StorePromptCache checks mlx-lm's version as it starts: a tested release only.
pytestmark = needs_tested_mlx_lm

PROMPT = "The quick brown fox jumps over the lazy dog. " * 4


def tokens_of(model, tokenizer, prompt, **kwargs):
    return [r.token for r in mlx_lm_stream_generate(model, tokenizer, prompt, **kwargs)]


@pytest.fixture
def lmdb_url(tmp_path):
    return f"lmdb://{tmp_path / 'store'}"


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3_text", "phi3"])
def test_restore_generate_insert_gives_the_tokens_of_no_store(arch, load, model_dirs, lmdb_url):
    model, tok = load(arch)
    prompt = tok.encode(PROMPT)
    turn1 = tokens_of(model, tok, prompt, max_tokens=10)
    with open_store(lmdb_url, block_size=16) as store:
        first = StorePromptCache(store, model)
        assert [
            r.token for r in stream_generate(model, tok, prompt, prompt_cache=first, max_tokens=10)
        ] == turn1
    # A restart: a new process would open the same directory with an empty memory LRU.
    follow = prompt + turn1 + tok.encode(" And then?")
    turn2 = tokens_of(model, tok, follow, max_tokens=10)
    with open_store(lmdb_url, block_size=16) as store:
        again = StorePromptCache(store, model_dirs[arch])  # the directory: the same namespace
        caches, rest = again.fetch(follow)
        reused = len(follow) - len(rest)
        assert reused == len(prompt) + len(turn1)  # the whole first turn
        assert caches[0].offset == reused
        assert all(isinstance(c, (KVCache, RotatingKVCache)) for c in caches)  # mlx-lm's
        got = [
            r.token
            for r in mlx_lm_stream_generate(model, tok, rest, prompt_cache=caches, max_tokens=10)
        ]
        assert got == turn2
        again.insert(follow + got, caches)
        assert again.stats()["writer"]["pending"] in (0, 1)  # handed to the store's writer
        again.flush()
        stats = again.stats()["prompt_cache"]
        assert stats["hits"] == {"store": 1} and stats["reused_tokens"] == {"store": reused}
        assert stats["saves"] == 1


def test_saves_are_committed_by_the_stores_writer_and_bounded(load, lmdb_url):
    """insert hands the save to store.save_behind and returns; the commit runs on the
    store's writer thread; beyond max_pending waiting saves, one is dropped and counted."""
    model, tok = load("llama")
    first, other = tok.encode(PROMPT), tok.encode("Zebras graze at dawn. " * 4)
    gate = threading.Event()
    committers: list[str] = []
    with open_store(lmdb_url, block_size=16) as store:
        real = store.put_blocks_many

        def held(saves):
            committers.append(threading.current_thread().name)
            gate.wait(30)  # the commit waits for the test
            return real(saves)

        store.put_blocks_many = held  # type: ignore[method-assign]
        cache = StorePromptCache(store, model, max_pending=1)
        want = tokens_of(model, tok, first, max_tokens=3)
        assert [
            r.token for r in stream_generate(model, tok, first, prompt_cache=cache, max_tokens=3)
        ] == want  # returned with its save's commit held
        # Another conversation's lookup does not wait for that commit; its save is dropped.
        list(stream_generate(model, tok, other, prompt_cache=cache, max_tokens=3))
        writer = cache.stats()["writer"]
        assert (writer["pending"], writer["written"], writer["dropped"]) == (1, 0, 1)
        assert cache.stats()["prompt_cache"]["saves_skipped"] == {QUEUE_FULL: 1}
        gate.set()
        cache.flush()
        writer = cache.stats()["writer"]
        assert (writer["pending"], writer["written"], writer["dropped"]) == (0, 1, 1)
        assert committers == ["kvstore-writer"]
        fresh = StorePromptCache(store, model)
        _, rest = fresh.fetch(first + want)
        assert len(rest) == 1  # the saved prompt and answer, all but the token to feed
        assert fresh.fetch(other)[1] == other  # the dropped save left nothing


def test_sliding_windows_reuse_a_shorter_prefix_through_captured_blocks(load, lmdb_url):
    model, tok = load("gemma3_text")  # windows of 16 tokens, blocks of 16
    prompt = tok.encode(PROMPT * 2)
    with open_store(lmdb_url, block_size=16) as store:
        cache = StorePromptCache(store, model)
        list(stream_generate(model, tok, prompt, prompt_cache=cache, max_tokens=4))
        fresh = StorePromptCache(store, model)
        shorter = prompt[:100] + tok.encode(" different")
        caches, rest = fresh.fetch(shorter)
        assert len(shorter) - len(rest) == 100  # not only the saved length
        assert any(isinstance(c, CapturingRotatingKVCache) for c in caches)
        got = [
            r.token
            for r in mlx_lm_stream_generate(model, tok, rest, prompt_cache=caches, max_tokens=6)
        ]
        assert got == tokens_of(model, tok, shorter, max_tokens=6)


def test_an_exact_hit_leaves_one_token_to_the_model(load):
    model, tok = load("llama")
    prompt = tok.encode(PROMPT)
    with open_store("memory://", block_size=16) as store:
        cache = StorePromptCache(store, model)
        caches, rest = cache.fetch(prompt)
        list(mlx_lm_stream_generate(model, tok, rest, prompt_cache=caches, max_tokens=1))
        held = caches[0].offset
        cache.insert(prompt + [0] * (held - len(prompt)) if held > len(prompt) else prompt, caches)
        exact = (prompt + [0] * (held - len(prompt)))[:held]
        stock, stock_rest = LRUPromptCache().fetch_nearest_cache("m", exact)
        assert stock is None  # (stock returns (cache, []) on an exact hit: see the server tests)
        caches, rest = cache.fetch(exact)  # memory: the whole prompt is known
        assert rest == exact[-1:] and caches[0].offset == len(exact) - 1
        assert cache.stats()["prompt_cache"]["exact_hits_guarded"] == 1
        fresh = StorePromptCache(store, model)  # the store: lookups always leave one
        caches, rest = fresh.fetch(exact)
        assert rest == exact[-1:] and caches[0].offset == len(exact) - 1


def test_feeding_the_whole_prompt_with_a_restored_cache_is_refused_at_insert(load):
    model, tok = load("llama")
    prompt = tok.encode(PROMPT)
    with open_store("memory://", block_size=16) as store:
        cache = StorePromptCache(store, model)
        list(stream_generate(model, tok, prompt, prompt_cache=cache, max_tokens=3))
        caches, rest = cache.fetch(prompt)
        assert len(rest) < len(prompt)
        generated = tokens_of(model, tok, prompt, prompt_cache=caches, max_tokens=3)  # wrong
        with pytest.raises(ValueError, match=r"feed only `rest`"):
            cache.insert(prompt + generated, caches)
        with pytest.raises(ValueError, match="pass only the tokens the caches hold"):
            cache.insert(prompt * 3, caches)


def test_hybrid_models_stay_in_memory_and_say_why(load):
    model, tok = load("qwen3_next")
    prompt = tok.encode(PROMPT)
    with open_store("memory://", block_size=16) as store:
        cache = StorePromptCache(store, model)
        binding = cache.binding()
        assert binding is not None and binding.namespace is None
        (why,) = binding.not_persisted.values()
        assert "ArraysCache" in why and "issue 16" in why
        turn1 = [
            r.token for r in stream_generate(model, tok, prompt, prompt_cache=cache, max_tokens=4)
        ]
        assert turn1 == tokens_of(model, tok, prompt, max_tokens=4)
        stats = cache.stats()
        assert stats["models"]["default"]["persisted"] is False
        assert stats["prompt_cache"]["misses"] == {NOT_PERSISTED: 1}
        assert stats["prompt_cache"]["saves_skipped"] == {NOT_PERSISTED: 1}
        assert store.stats().blocks == 0
        # mlx-lm's in-memory behaviour is kept: the next turn reuses the first from memory.
        follow = prompt + turn1 + tok.encode(" more")
        caches, rest = cache.fetch(follow)
        assert cache.stats()["prompt_cache"]["hits"] == {"memory": 1}
        assert len(follow) - len(rest) == len(prompt) + len(turn1)


def test_image_prompts_are_not_persisted(load):
    model, _ = load("llama")
    with open_store("memory://", block_size=16) as store:
        cache = StorePromptCache(store, model)
        key = [1, 2, -77, -77, 3, 4] * 5  # mlx-lm's server keys image patches by negative ids
        assert cache.fetch_nearest_cache("default", key) == (None, key)
        assert cache.stats()["prompt_cache"]["misses"] == {IMAGE_PROMPT: 1}


def test_quantized_kv_restores_quantized_where_mlx_lm_would_hold_it_so(load):
    model, tok = load("llama")
    prompt = tok.encode(PROMPT)
    kw = dict(kv_bits=8, kv_group_size=64, quantized_kv_start=0)
    with open_store("memory://", block_size=16) as store:
        cache = StorePromptCache(store, model, **kw)
        turn1 = [
            r.token
            for r in stream_generate(model, tok, prompt, prompt_cache=cache, max_tokens=5, **kw)
        ]
        assert turn1 == tokens_of(model, tok, prompt, max_tokens=5, **kw)
        fresh = StorePromptCache(store, model, **kw)
        follow = prompt + turn1 + tok.encode(" ok")
        caches, rest = fresh.fetch(follow)
        assert len(rest) < len(tok.encode(" ok")) + 1
        assert all(type(c) is OurQuantizedKVCache for c in caches)  # ours: they batch
        # The same continuation as mlx-lm's own in-memory prompt cache gives.
        mem_caches = make_prompt_cache(model)
        list(
            mlx_lm_stream_generate(model, tok, prompt, prompt_cache=mem_caches, max_tokens=5, **kw)
        )
        want = tokens_of(
            model, tok, follow[mem_caches[0].offset :], prompt_cache=mem_caches, max_tokens=5, **kw
        )
        assert tokens_of(model, tok, rest, prompt_cache=caches, max_tokens=5, **kw) == want
        plain = StorePromptCache(store, model)  # without kv_bits: another namespace
        assert plain.binding().namespace != fresh.binding().namespace
        caches, rest = plain.fetch(follow)
        assert rest == follow and all(type(c) is KVCache for c in caches)


def test_a_store_that_fails_is_a_miss_never_an_error(load, tmp_path):
    from kvstore.testing.redis_servers import RedisServer, redis_binaries

    if redis_binaries() is None:
        pytest.skip("redis-server is needed")
    model, tok = load("llama")
    prompt = tok.encode(PROMPT)
    server = RedisServer(tmp_path / "redis").start()
    try:
        store = open_store(server.url, block_size=16, socket_timeout=2, connect_timeout=1)
        cache = StorePromptCache(store, model)
        list(stream_generate(model, tok, prompt, prompt_cache=cache, max_tokens=3))
        server.kill()
        fresh = StorePromptCache(store, model)
        caches, rest = fresh.fetch(prompt)
        assert rest == prompt and caches[0].offset == 0
        assert fresh.stats()["prompt_cache"]["misses"] == {MissReason.UNAVAILABLE: 1}
        fresh.insert_cache("default", prompt[:20], make_prompt_cache(model))  # nothing to save
        list(stream_generate(model, tok, prompt, prompt_cache=fresh, max_tokens=3))
        assert fresh.stats()["prompt_cache"]["save_errors"] == {MissReason.UNAVAILABLE: 1}
    finally:
        server.stop()
