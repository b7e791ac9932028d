"""A loaded model's kernels made ready before its first request.

MLX builds a kernel the first time a process runs it: on a GPU a process's first
forward compiles and loads its kernels (about a second with MLX's CUDA backend; Metal
builds its pipelines), so the first request after a server starts would wait for that
on top of its prefill or its restore -- the request the store exists to make fast,
the one after a restart. llama.cpp warms a model up the same way by default.

:func:`warm_up` runs a short prefill and one decode step through the model on caches
of its own, thrown away after: the prefill's and the decode's kernels (the full and
the vector attention) are built, and nothing reaches the prompt cache or the store.
On a CUDA GPU it also starts the process's one trial of the restore's page route in
the background (:func:`kvstore.codecs.cuda_pages.proven`): a process's first restore
stages its rows instead while that trial has not passed (its kernel's first load
compiles it, about a second), and after a restart that first restore is the first
request's.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import mlx.core as mx

from kvstore.abc.cache import is_plain_kv_cache
from kvstore.codecs import cuda_pages
from kvstore.devices import default_is_cuda
from kvstore.knobs import switch_from_env
from kvstore.store.kv.writer import handoff_copies

__all__ = [
    "PREFILL_TOKENS",
    "STAGING_THREAD",
    "build_batch_kernels",
    "build_decode_graphs",
    "build_kernels",
    "warm_up",
]

log = logging.getLogger("kvstore.serve")

#: The switch (on unless ``"0"``) that sets the restore's staging up on a thread of its
#: own once the warm-up is done, while requests run (a restore arriving first waits for
#: it on its lock); off, on the warm-up's thread, the generating one, before a first
#: request runs. On one H100 (``tools/bench/results/gpu/staging-h100/``) the set-up took
#: 3.4-4.5 s of a fresh 8B server's warm-up on that thread (0.5-0.7 s without it), and a
#: restore after a restart took the same either way (197 and 196 ms, medians of 2).
STAGING_THREAD = "KVSTORE_WARMUP_STAGING_THREAD"

#: The warm-up prefill's length: several rows, so the prefill's matmuls and attention
#: take the kernels a prompt's do, not a decode step's.
PREFILL_TOKENS = 32


def warm_up(
    model: Any,
    tokens: int = PREFILL_TOKENS,
    *,
    kv_bits: int | None = None,
    kv_group_size: int = 64,
    decode_up_to: int = 0,
    batched: bool = False,
) -> float | None:
    """:func:`build_kernels` (with ``batched``, the server's batched generation too:
    :func:`build_batch_kernels`), and with ``decode_up_to`` on a CUDA GPU
    :func:`build_decode_graphs` up to that many tokens; then, on a CUDA GPU, the restore's
    staging set up (its kernels built) and its page route's trial started, on a thread of
    their own (:data:`STAGING_THREAD`). Timed -- a first request waits for what ran on
    this thread: the seconds it took, or ``None`` (logged) when the model's forward
    failed: a request then meets the same error, with its own message, and the server
    stays up."""
    start = time.perf_counter()
    try:
        build_kernels(model, tokens, kv_bits=kv_bits, kv_group_size=kv_group_size)
        if batched:
            build_batch_kernels(model, tokens)
        if decode_up_to and default_is_cuda():  # cuDNN's graphs: nothing to build elsewhere
            sizes = build_decode_graphs(model, decode_up_to)
            log.info("kvstore: decode graphs of %d buffer sizes built", sizes)
    except Exception as exc:  # noqa: BLE001 - a warm-up never stops the server
        log.warning("kvstore: the model's warm-up failed (%s: %s)", type(exc).__name__, exc)
        return None
    if switch_from_env(STAGING_THREAD):  # a restore arriving first waits on its lock
        threading.Thread(target=_set_up_staging, name="kvstore-staging-setup").start()
    else:
        _set_up_staging()
    return time.perf_counter() - start


def _set_up_staging() -> None:
    """The restore's staging set up and its page route's trial started (at once without
    CUDA); a failure is logged, never raised: the server stays up, and a restore meets
    the same failure where it can say what it cost."""
    try:
        cuda_pages.proven()
    except Exception as exc:  # noqa: BLE001 - a warm-up never stops the server
        log.warning(
            "kvstore: the restore's staging set-up failed (%s: %s)", type(exc).__name__, exc
        )


def build_kernels(
    model: Any,
    tokens: int = PREFILL_TOKENS,
    *,
    kv_bits: int | None = None,
    kv_group_size: int = 64,
) -> None:
    """Run a prefill of ``tokens`` tokens (token id 0) and one decode step of ``model``
    on fresh caches, evaluated, then the copies a save's hand-off makes of those rows;
    with ``kv_bits`` (the server's ``--kv-bits``) one more step on those caches
    quantized as mlx-lm quantizes them, so that attention over packed rows is built
    too, and a hand-off's copies of them. Raises what the model's forward raises."""
    from mlx_lm.generate import maybe_quantize_kv_cache
    from mlx_lm.models.cache import make_prompt_cache

    caches = make_prompt_cache(model)
    mx.eval(model(mx.zeros((1, tokens), mx.int32), cache=caches))
    mx.eval(model(mx.zeros((1, 1), mx.int32), cache=caches))
    mx.eval(handoff_copies(caches, 0, tokens))  # a save's hand-off: its copies' kernels
    if kv_bits is not None:
        maybe_quantize_kv_cache(caches, 0, kv_group_size, kv_bits)
        mx.eval(model(mx.zeros((1, 1), mx.int32), cache=caches))
        mx.eval(handoff_copies(caches, 0, tokens))  # packed rows: other copies' kernels


def build_batch_kernels(model: Any, tokens: int = PREFILL_TOKENS, steps: int = 3) -> int:
    """One request of ``tokens`` tokens (token id 0) and ``steps`` generated through
    mlx-lm's ``BatchGenerator`` -- what ``mlx_lm.server`` serves a batchable model's
    requests with: its batched caches, masks and sampling, whose kernels
    :func:`build_kernels`' plain caches do not build (a fresh 8B server's turn after a
    restart held one gap of ~50 ms between tokens on an H100, as long as stock's).
    Returns the tokens generated. Raises what the model's forward raises."""
    from mlx_lm.generate import BatchGenerator

    generator = BatchGenerator(model, max_tokens=steps)
    generated = 0
    try:
        generator.insert([[0] * tokens], max_tokens=[steps])
        for _ in range(4 * steps + 8):  # the prompt's chunks, then one token a step
            prompt_responses, responses = generator.next()
            generated += len(responses)
            if any(r.finish_reason is not None for r in responses):
                break
            if not prompt_responses and not responses:
                break
    finally:
        generator.close()
    return generated


def build_decode_graphs(model: Any, up_to: int, step: int = 256) -> int:
    """One decode step of ``model`` over caches whose buffers hold each multiple of
    ``step`` rows up to ``up_to`` tokens (zeros, all rows but the last written); returns
    how many sizes ran. Raises what the model's forward raises.

    With MLX's CUDA backend a decode step over 256 or more cached rows, in a buffer of a
    multiple of 256 rows (how caches grow), runs cuDNN's attention, which builds a graph
    the first time it meets a buffer size in a thread (its key: the buffer's rows and the
    query's shape and strides; ``sdpa_cache`` in MLX's
    ``backend/cuda/scaled_dot_product_attention.cpp``): a conversation's first step into
    each new size waits for one. This builds them ahead, through the model's own forward
    so that the key is the one its steps make. Caches that do not grow (a sliding window)
    stay empty: their buffers have one size. Run it on the thread that will generate.
    Only unmasked steps take that path: ``mlx_lm.server``'s batched steps pass an array
    mask (``BatchKVCache.make_mask``), which MLX's CUDA attention runs without cuDNN, so
    these graphs serve the requests it serves one at a time (a seed, a draft model)."""
    from mlx_lm.models.cache import make_prompt_cache

    token = mx.zeros((1, 1), mx.int32)
    probe = make_prompt_cache(model)
    mx.eval(model(token, cache=probe))
    sizes = range(step, up_to + step, step) if up_to >= step else range(0)
    for size in sizes:
        _step_over(model, token, make_prompt_cache(model), probe, size)
    mx.clear_cache()  # the buffers of every size go back, not into the allocator's cache
    return len(sizes)


def _step_over(model: Any, token: mx.array, caches: list[Any], probe: list[Any], size: int) -> None:
    """One decode step on ``caches`` with each growing one's buffers ``size`` rows of zeros
    (the dtype and heads of ``probe``'s), all but the last written."""
    filled = []
    for cache, seen in zip(caches, probe, strict=True):
        if not is_plain_kv_cache(cache) or seen.keys is None:
            continue  # only growing caches of plain rows take cuDNN's decode
        shape = (*seen.keys.shape[:2], size, seen.keys.shape[3])
        cache.keys = mx.zeros(shape, seen.keys.dtype)
        cache.values = mx.zeros(shape, seen.values.dtype)
        cache.offset = size - 1
        filled += [cache.keys, cache.values]
    mx.eval(filled)  # first: MLX takes cuDNN's route only for evaluated buffers
    mx.eval(model(token, cache=caches))
