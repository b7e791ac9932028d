"""kvstore.serve.warmup: a model run once as it loads, on caches of its own; a model whose
forward fails is reported, never raised into the server."""

from __future__ import annotations

import logging

import mlx.core as mx
import pytest

from kvstore.abc.cache import is_plain_kv_cache
from kvstore.codecs import cuda_pages
from kvstore.serve import warmup
from kvstore.serve.warmup import PREFILL_TOKENS, build_decode_graphs, warm_up
from kvstore.store.kv import writer
from kvstore.testing.mlx_lm_models import build_mlx_lm_model


class Recording:
    """``model``, noting each call's input length and its caches' offsets after it."""

    def __init__(self, model):
        self.model, self.calls, self.kinds = model, [], []

    def __getattr__(self, name):  # layers, make_cache...: make_prompt_cache asks them
        return getattr(self.model, name)

    def __call__(self, inputs, cache=None):
        out = self.model(inputs, cache=cache)
        mx.eval(out)
        self.calls.append((inputs.shape[1], [getattr(c, "offset", 0) for c in cache], id(cache)))
        self.kinds.append({type(c).__name__ for c in cache})
        return out


@pytest.mark.parametrize("arch", ["llama", "qwen3_next"])
def test_a_prefill_and_one_decode_step_run_on_caches_of_their_own(arch, monkeypatch):
    asked = []  # the restore's page route tried in the background (CUDA only)
    monkeypatch.setattr(cuda_pages, "proven", lambda: asked.append(True) or False)
    model = Recording(build_mlx_lm_model(arch))
    took = warm_up(model)
    assert asked == [True]
    assert took is not None and took > 0
    (n1, offsets1, caches1), (n2, offsets2, caches2) = model.calls
    assert (n1, n2) == (PREFILL_TOKENS, 1) and caches1 == caches2  # one set, thrown away
    held = [o for o in offsets2 if o]  # a recurrent layer's state keeps no offset
    assert held and set(held) == {PREFILL_TOKENS + 1}


def test_with_kv_bits_one_more_step_runs_over_the_caches_quantized():
    model = Recording(build_mlx_lm_model("llama"))
    assert warm_up(model, kv_bits=8, kv_group_size=32) is not None
    assert [n for n, _, _ in model.calls] == [PREFILL_TOKENS, 1, 1]
    assert model.kinds == [{"KVCache"}, {"KVCache"}, {"QuantizedKVCache"}]
    assert set(model.calls[2][1]) == {PREFILL_TOKENS + 2}


def test_a_model_whose_forward_fails_is_logged_not_raised(caplog):
    class Broken(Recording):
        def __call__(self, inputs, cache=None):
            raise ValueError("no kernel for this shape")

    with caplog.at_level(logging.WARNING, logger="kvstore.serve"):
        assert warm_up(Broken(build_mlx_lm_model("llama"))) is None
    assert "warm-up failed (ValueError: no kernel for this shape)" in caplog.text


class Buffers(Recording):
    """``model``, noting each call's caches: (family predicate, offset, buffer rows)."""

    def __call__(self, inputs, cache=None):
        out = self.model(inputs, cache=cache)
        mx.eval(out)
        self.calls.append(
            [
                (is_plain_kv_cache(c), c.offset, None if c.keys is None else c.keys.shape[2])
                for c in cache
            ]
        )
        return out


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_decode_graphs_step_over_a_buffer_of_every_size_a_conversation_meets(arch):
    model = Buffers(build_mlx_lm_model(arch))
    # Up to 600 tokens: the buffers hold 256, 512, then 768 rows.
    assert build_decode_graphs(model, 600) == 3
    probe, *steps = model.calls
    assert {offset for _, offset, _ in probe} == {1}
    for size, layers in zip((256, 512, 768), steps, strict=True):
        plain = [(offset, rows) for is_plain, offset, rows in layers if is_plain]
        # The step wrote the buffer's last row: attention read a slice of all of it.
        assert plain and set(plain) == {(size, size)}
        # A sliding window's buffer has one size: it stays as a fresh cache's first step.
        assert {offset for is_plain, offset, _ in layers if not is_plain} <= {1}
    assert arch != "gemma3_text" or any(not p for p, _, _ in steps[0])
    assert build_decode_graphs(model, 255) == 0  # no buffer of 256 rows is reached


@pytest.mark.parametrize("cuda", [False, True])
def test_warm_up_builds_decode_graphs_only_where_cuda_runs_them(cuda, monkeypatch):
    monkeypatch.setattr(warmup, "default_is_cuda", lambda: cuda)
    model = Buffers(build_mlx_lm_model("llama"))
    assert warm_up(model, decode_up_to=300) is not None
    # The prefill and the decode step; on CUDA the probe step and buffers of 256, 512 rows.
    assert len(model.calls) == (5 if cuda else 2)
    assert [rows for _, _, rows in model.calls[-1]][:1] == [512 if cuda else 256]


@pytest.mark.parametrize("own_thread", [True, False])
def test_the_staging_set_up_runs_on_its_own_thread_unless_switched_off(own_thread, monkeypatch):
    import threading

    ran = []  # the threads that set the restore's staging up (a no-op without CUDA)
    done = threading.Event()
    monkeypatch.setattr(
        cuda_pages, "proven", lambda: ran.append(threading.current_thread().name) or done.set()
    )
    if not own_thread:
        monkeypatch.setenv(warmup.STAGING_THREAD, "0")
    assert warm_up(Recording(build_mlx_lm_model("llama"))) is not None
    assert done.wait(10)
    assert ran == ["kvstore-staging-setup" if own_thread else threading.current_thread().name]


@pytest.mark.parametrize("own_thread", [True, False])
def test_a_failing_staging_set_up_is_logged_and_the_warm_up_stands(own_thread, monkeypatch, caplog):
    import time

    def fail():
        raise RuntimeError("no pinned memory here")

    monkeypatch.setattr(cuda_pages, "proven", fail)
    if not own_thread:
        monkeypatch.setenv(warmup.STAGING_THREAD, "0")
    with caplog.at_level("WARNING", logger="kvstore.serve"):
        assert warm_up(Recording(build_mlx_lm_model("llama"))) is not None
        deadline = time.monotonic() + 60  # the thread logs it; no timing is asserted
        while not caplog.records and time.monotonic() < deadline:
            time.sleep(0.01)
    assert [r.getMessage() for r in caplog.records] == [
        "kvstore: the restore's staging set-up failed (RuntimeError: no pinned memory here)"
    ]


@pytest.mark.parametrize("arch", ["llama", "qwen3_next"])
def test_the_warm_up_makes_a_save_hand_offs_copies_of_its_rows(arch, monkeypatch):
    # A fresh process's first hand-off waited 146 ms on one H100 for its copy kernel's
    # first use: the warm-up makes the same copies once (a recurrent layer has none).
    made = []

    def recorded(caches, start, stop):
        copies = writer.handoff_copies(caches, start, stop)
        made.append((caches, start, stop, copies))
        return copies

    monkeypatch.setattr(warmup, "handoff_copies", recorded)
    monkeypatch.setattr(cuda_pages, "proven", lambda: False)
    model = Recording(build_mlx_lm_model(arch))
    assert warm_up(model) is not None
    ((caches, start, stop, copies),) = made
    assert (start, stop) == (0, PREFILL_TOKENS) and id(caches) == model.calls[0][2]
    plain = [c for c in caches if is_plain_kv_cache(c)]
    assert plain and len(copies) == 2 * len(plain)  # keys and values of each attention layer
    for cache, (keys, values) in zip(
        plain, zip(copies[::2], copies[1::2], strict=True), strict=True
    ):
        assert keys.shape[2] == PREFILL_TOKENS and values.shape[2] == PREFILL_TOKENS
        assert mx.array_equal(keys, cache.keys[..., :PREFILL_TOKENS, :]).item()
        assert mx.array_equal(values, cache.values[..., :PREFILL_TOKENS, :]).item()


def test_batched_the_warm_up_runs_a_request_through_mlx_lms_batch_generator(monkeypatch):
    # mlx_lm.server serves a batchable model's requests through BatchGenerator: batched
    # caches and masks a plain-cache warm-up never builds.
    monkeypatch.setattr(cuda_pages, "proven", lambda: False)
    plain = Recording(build_mlx_lm_model("llama"))
    assert warm_up(plain) is not None
    assert all("BatchKVCache" not in kinds for kinds in plain.kinds)
    batched = Recording(build_mlx_lm_model("llama"))
    assert warm_up(batched, batched=True) is not None
    runs = [(n, kinds) for (n, _, _), kinds in zip(batched.calls, batched.kinds, strict=True)]
    assert runs[:2] == [(PREFILL_TOKENS, {"KVCache"}), (1, {"KVCache"})]  # build_kernels
    after = runs[2:]
    assert after and all(kinds == {"BatchKVCache"} for _, kinds in after)
    # the prompt (its last token held back for the first step), then the steps: one
    # token a step for the 3 generated (mlx-lm computes one more, never returned)
    assert [n for n, _ in after] == [PREFILL_TOKENS - 1, 1, 1, 1, 1]
    assert warmup.build_batch_kernels(build_mlx_lm_model("llama")) == 3


def test_with_kv_bits_the_hand_offs_copies_of_packed_rows_are_made_too(monkeypatch):
    made = []

    def recorded(caches, start, stop):
        copies = writer.handoff_copies(caches, start, stop)
        made.append(({type(c).__name__ for c in caches}, len(copies)))
        return copies

    monkeypatch.setattr(warmup, "handoff_copies", recorded)
    monkeypatch.setattr(cuda_pages, "proven", lambda: False)
    model = build_mlx_lm_model("llama")
    assert warm_up(model, kv_bits=8, kv_group_size=32) is not None
    layers = len(model.layers)
    # plain keys and values, then each one's packed rows, scales and biases
    assert made == [({"KVCache"}, 2 * layers), ({"QuantizedKVCache"}, 6 * layers)]
