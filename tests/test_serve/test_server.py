"""``kvstore serve`` against stock ``mlx_lm.server``: same text, reuse across restarts and
processes, the batched and sequential paths, the exact-hit crash guarded, the endpoints."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvstore.model.attention import UNFUSED_ATTENTION
from kvstore.testing.serve_processes import ServerProcess
from tests.markers import needs_tested_mlx_lm

from .conftest import SYSTEM, chat, chat_stream, complete, conversation

pytestmark = needs_tested_mlx_lm


@pytest.fixture(scope="module")
def store_url(tmp_path_factory):
    return f"lmdb://{tmp_path_factory.mktemp('serve-store')}"


@pytest.fixture(scope="module")
def servers(model_dir, hybrid_dir, store_url, server_env, logs, tmp_path_factory):
    """Started at once: stock mlx_lm.server; two kvstore servers on one LMDB store (b
    attending every call of several queries by plain ops); one quantizing the KV from the
    first token (--kv-bits 8); one serving a hybrid model (not warmed up); one with a
    draft model (speculative decoding)."""
    stock = ServerProcess.stock(model_dir, log=logs / "stock.log", env=server_env)
    a = ServerProcess.kvstore(model_dir, store_url, log=logs / "a.log", env=server_env)
    unfused = {**server_env, UNFUSED_ATTENTION: "always"}
    # --warm-decode parses and passes through (off CUDA it builds nothing: cuDNN's graphs).
    b = ServerProcess.kvstore(
        model_dir, store_url, "--warm-decode", "300", log=logs / "b.log", env=unfused
    )
    q_store = f"lmdb://{tmp_path_factory.mktemp('q-store')}"
    kv = ("--kv-bits", "8", "--kv-group-size", "64", "--quantized-kv-start", "0")
    q = ServerProcess.kvstore(model_dir, q_store, *kv, log=logs / "q.log", env=server_env)
    h_store = f"lmdb://{tmp_path_factory.mktemp('h-store')}"
    h = ServerProcess.kvstore(
        hybrid_dir, h_store, "--no-warmup", log=logs / "hybrid.log", env=server_env
    )
    d_store = f"lmdb://{tmp_path_factory.mktemp('d-store')}"
    draft = ("--draft-model", str(model_dir))
    d = ServerProcess.kvstore(model_dir, d_store, *draft, log=logs / "d.log", env=server_env)
    ServerProcess.start_all(stock, a, b, q, h, d)
    running = {"stock": stock, "a": a, "b": b, "q": q, "hybrid": h, "draft": d}
    yield running  # a test may replace one (a restart)
    for server in running.values():
        server.stop()


@pytest.fixture(scope="module")
def stock(servers):
    return servers["stock"]


@pytest.fixture(scope="module")
def ours(servers):
    return servers["a"]


REQUESTS = [
    conversation("Which module parses command lines?"),
    conversation("What does functools.lru_cache do?"),
    conversation("And its maxsize?", ("What does functools.lru_cache do?", "It memoizes.")),
]


def test_each_model_is_warmed_up_as_it_loads_and_the_warm_up_saves_nothing(servers):
    # First in the module: no request has reached a, b or h yet. The model loads on
    # mlx-lm's generation thread, after /health answers: wait for it (four servers load
    # at once on CI's two cores; the deadline only bounds a failure).
    deadline = time.monotonic() + 300
    while not all(servers[k].stats()["server"]["warmup_s"] for k in ("a", "b", "draft")):
        assert time.monotonic() < deadline, "no warm-up reported"
        time.sleep(0.2)
    for name in ("a", "b"):
        stats = servers[name].stats()
        ((path, took),) = stats["server"]["warmup_s"].items()
        assert path.endswith("tiny-llama") and took is not None and took > 0
        assert stats["prompt_cache"]["saves"] == 0 and stats["prompt_cache"]["hits"] == {}
    assert servers["a"].stats()["store"]["blocks"] == 0  # a's and b's store
    warmed = servers["draft"].stats()["server"]["warmup_s"]  # the draft model too
    assert sorted(warmed) == [path, f"{path} (draft)"] and all(warmed.values())
    while not servers["hybrid"].stats()["models"]:  # loaded (and bound) ...
        assert time.monotonic() < deadline, "the hybrid model never loaded"
        time.sleep(0.2)
    assert servers["hybrid"].stats()["server"]["warmup_s"] == {}  # ... not warmed: --no-warmup
    # What a first request waited for besides the warm-up: the load and the binding, of
    # every server's model (one entry a model path; a draft loads within its model's).
    for name in ("a", "b", "draft", "hybrid"):
        ((path, took),) = servers[name].stats()["server"]["load_s"].items()
        assert sorted(took) == ["bind", "weights"] and took["weights"] > 0 < took["bind"]
        assert path == next(iter(servers[name].stats()["server"]["warmup_s"]), path)


def test_the_models_attention_routes_few_queries_through_plain_ops_as_set(servers):
    # mlx-lm's llama module attends through kvstore.mlx_lm.attention in both servers;
    # a's (auto) keeps the fused kernel on this CPU, b's (always) takes plain ops.
    for name, mode in (("a", "auto"), ("b", "always")):
        routed = servers[name].stats()["server"]["unfused_attention"]
        assert routed == {"modules": ["mlx_lm.models.llama"], "mode": mode}


def test_greedy_text_is_the_stock_servers_streaming_and_not(stock, ours):
    for messages in REQUESTS:
        want = chat(stock, messages)[0]
        assert want  # the tiny model writes something
        assert chat(ours, messages)[0] == want
        assert chat_stream(ours, messages)[0] == want  # now served from the cache
        assert chat_stream(stock, messages)[0] == want
    prompt = "import collections\n" * 20
    assert complete(ours, prompt) == complete(stock, prompt)


def test_two_live_servers_share_one_store(servers, stock):
    a, b = servers["a"], servers["b"]
    messages = conversation("Which module reads CSV files?")
    text, _, prompt_tokens = chat(a, messages)
    a.wait_saved()
    again, cached, _ = chat(b, messages)
    assert again == text == chat(stock, messages)[0]
    assert cached == prompt_tokens - 1  # all but the token the model must see
    assert b.stats()["prompt_cache"]["hits"] == {"store": 1}


def test_plain_op_attention_writes_the_stock_servers_text(stock, servers):
    b = servers["b"]  # after the test above: it counts b's hits
    for messages in REQUESTS:
        want = chat(stock, messages)[0]
        assert chat(b, messages)[0] == want
        assert chat_stream(b, messages)[0] == want


@pytest.mark.parametrize("name", ["a", "b"])  # b: attention by plain ops, batched too
def test_concurrent_requests_take_the_batched_path_and_reuse(stock, servers, name):
    server = servers[name]
    topics = ["paths", "json", "regular expressions", "sockets"]
    questions = [f"Question {i}: which module handles {w}?" for i, w in enumerate(topics)]
    chat(server, conversation("Warm the system prompt."), max_tokens=2)
    server.wait_saved()
    want = [chat(stock, conversation(q))[0] for q in questions]
    with ThreadPoolExecutor(len(questions)) as pool:
        got = list(pool.map(lambda q: chat(server, conversation(q)), questions))
    assert [g[0] for g in got] == want
    assert all(cached >= len(SYSTEM) for _, cached, _ in got)  # the system prompt, at least


def batched_system_prompts(server: ServerProcess) -> int:
    """System-prompt caches inserted: only mlx-lm's batched path inserts those."""
    return int(server.stats()["prompt_cache"]["inserts"].get("system", 0))


def test_quantized_kv_takes_the_batched_path_and_reuses(servers):
    q = servers["q"]
    topics = ["paths", "json", "sockets"]
    questions = [
        conversation(f"Quantized {i}: which module handles {w}?") for i, w in enumerate(topics)
    ]
    with ThreadPoolExecutor(len(questions)) as pool:
        cold = list(pool.map(lambda m: chat(q, m), questions))
    q.wait_saved()
    with ThreadPoolExecutor(len(questions)) as pool:
        warm = list(pool.map(lambda m: chat(q, m), questions))
    assert [w[0] for w in warm] == [c[0] for c in cold]  # the text of no reuse
    assert all(cached == prompt - 1 for _, cached, prompt in warm)
    assert batched_system_prompts(q) >= 1  # mlx-lm alone would serve --kv-bits one at a time
    stats = q.stats()
    (model,) = stats["models"].values()
    assert model["kv_bits"] == 8 and model["persisted"]
    # seed requests go the sequential way, and reuse there too
    seeded = conversation("Quantized and seeded.")
    before = batched_system_prompts(q)
    first = chat(q, seeded, seed=3)
    assert chat(q, seeded, seed=3) == (first[0], first[2] - 1, first[2])
    assert batched_system_prompts(q) == before


def test_a_hybrid_model_stays_in_memory_and_says_why(servers):
    h = servers["hybrid"]
    messages = [{"role": "user", "content": "Hybrid models keep recurrent state. " * 3}]
    text, cached, prompt_tokens = chat(h, messages)
    assert cached == 0 and text
    again = chat(h, messages)
    assert again[0] == text and again[1] > 0  # mlx-lm's in-memory reuse is kept
    stats = h.stats()
    (model,) = stats["models"].values()
    assert model["persisted"] is False and model["namespace"] is None
    (why,) = model["not_persisted"].values()
    assert "ArraysCache" in why and "issue 16" in why
    assert stats["prompt_cache"]["misses"] == {"not_persisted": 1}
    assert stats["store"]["blocks"] == 0
    assert "stays in memory only" in h.log.read_text()


def test_seed_requests_take_the_sequential_path_and_reuse(stock, ours):
    server = ours
    messages = conversation("A seeded question about itertools.")
    want = chat(stock, messages, seed=7)[0]
    text, cached, prompt_tokens = chat(server, messages, seed=7)
    assert text == want and cached > 0
    text, cached, _ = chat(server, messages, seed=7)
    assert text == want and cached == prompt_tokens - 1


def test_health_metrics_and_stats(ours):
    server = ours
    status, body = server.get("/health")
    assert (status, json.loads(body)) == (200, {"status": "ok"})
    status, body = server.get("/metrics")
    assert status == 200
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    for name in (
        "kvstore_prompt_cache_hits",
        "kvstore_prompt_cache_misses",
        "kvstore_reused_tokens",
        "kvstore_saved_bytes",
        "kvstore_restore_seconds",
        "kvstore_save_seconds",
        "kvstore_time_to_first_token_seconds",
        "kvstore_store_bytes",
        "kvstore_save_queue_depth",
        "kvstore_save_handoff_seconds",
    ):
        assert name in families, name
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in families.values()
        for s in f.samples
    }
    hits = {
        src: samples[("kvstore_prompt_cache_hits_total", (("source", src),))]
        for src in ("memory", "store")
    }
    assert hits["memory"] >= 1 and hits["store"] == 0  # this server's reuse came from memory
    assert samples[("kvstore_prompt_cache_misses_total", (("reason", "unavailable"),))] == 0
    assert samples[("kvstore_saved_bytes_total", ())] > 0
    assert samples[("kvstore_time_to_first_token_seconds_count", ())] >= 1
    assert samples[("kvstore_store_up", ())] == 1
    stats = server.stats()
    assert stats["store"]["up"] is True and stats["store"]["blocks"] > 0
    (model,) = stats["models"].values()
    assert model["persisted"] is True and len(model["namespace"]) == 16
    assert stats["writer"]["dropped"] == 0


def test_a_restart_reuses_what_was_saved(servers, model_dir, store_url, server_env, logs):
    stock, b = servers["stock"], servers["b"]
    first = conversation("Name three modules for dates.")
    answer, cached, prompt_tokens = chat(b, first, max_tokens=16)
    stats = b.wait_saved()
    assert stats["prompt_cache"]["saves"] >= 1 and stats["store"]["blocks"] >= 3
    b.stop()  # SIGTERM: queued saves are written, the store closed
    follow = conversation("And for time zones?", ("Name three modules for dates.", answer))
    restarted = ServerProcess.kvstore(
        model_dir, store_url, log=logs / "b-restarted.log", env=server_env
    )
    servers["b"] = restarted.start()
    text, cached, _ = chat(restarted, follow)
    assert text == chat(stock, follow)[0]
    assert cached >= 0.95 * prompt_tokens  # the whole first turn, after a restart
    stats = restarted.stats()["prompt_cache"]
    assert stats["hits"] == {"store": 1} and stats["reused_tokens"]["store"] == cached


def exact_hit_prompt(server: ServerProcess) -> tuple[str, str]:
    """A text prompt whose one generated token is a printable ASCII byte: that prompt plus
    it is then exactly a stored key (the prompt and the token that has KV)."""
    for i in range(64):
        prompt = f"Say {i}:"
        status, body = server.post("/v1/completions", {"prompt": prompt, "max_tokens": 1})
        assert status == 200
        text = body["choices"][0]["text"]
        if len(text) == 1 and text.isascii() and text.isprintable():
            return prompt, text
    pytest.fail("no prompt gave a printable ASCII token")


def test_the_exact_hit_that_kills_the_stock_server_returns_200_three_times(ours, stock):
    server = ours
    prompt, token = exact_hit_prompt(server)
    before = server.stats()["prompt_cache"]["exact_hits_guarded"]
    for _ in range(3):
        status, body = server.post("/v1/completions", {"prompt": prompt + token, "max_tokens": 1})
        assert status == 200, body
    assert server.stats()["prompt_cache"]["exact_hits_guarded"] > before
    assert server.get("/health")[0] == 200
    # The same sequence on mlx-lm 0.32.2's own server (last: it does not survive it).
    stock_prompt, stock_token = exact_hit_prompt(stock)
    assert (stock_prompt, stock_token) == (prompt, token)
    statuses = [
        stock.post("/v1/completions", {"prompt": prompt + token, "max_tokens": 1})[0]
        for _ in range(3)
    ]
    assert statuses[0] != 200 and stock.get("/health")[0] == 503
