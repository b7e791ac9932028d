"""Benchmark workloads: synthetic KV in the shapes of real models, and the peers' cases.

The shapes are BENCHMARKS.md's (``llama8b``, ``qwen0.5b``, ``gemma-swa``).
Rows are seeded bfloat16 values, fed in prefill chunks of 2048 tokens
(mlx-lm's ``prefill_step_size``) to our caches (:mod:`kvstore.caches`) or
to mlx-lm's, so both hold what a real prefill leaves behind: same buffers,
same ring state, same bytes. Each builder regenerates the rows from the
seed rather than keeping them, so only the caches asked for occupy memory.

The peer cases every figure shares live here too: mlx-lm's
``load_prompt_cache``/``save_prompt_cache`` of the same cache and the memcpy
limit (``numpy.copyto`` into an already-touched buffer of the same size).
"""

from __future__ import annotations

import mmap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from kvstore.bench.harness import Case
from kvstore.family import windowed_family
from kvstore.files import fsync_path
from kvstore.signature import parse_signature

__all__ = [
    "KVShape",
    "WORKLOADS",
    "PREFILL_STEP",
    "SyntheticKV",
    "synthetic_kv",
    "windowed_signature",
    "attended_arrays",
    "cache_arrays",
    "cache_nbytes",
    "first_step",
    "memcpy_case",
    "mlx_lm_load_case",
    "mlx_lm_save_case",
    "with_first_step",
]

#: mlx-lm's default ``prefill_step_size``: the chunk a real prefill feeds a cache.
PREFILL_STEP = 2048
_BF16_BYTES = 2
# bfloat16 words: keep the sign, mantissa and lowest exponent bit; exponent 124 or 125.
_KEEP_BITS, _EXPONENT_BITS = np.uint16(0x80FF), np.uint16(0x3E00)


@dataclass(frozen=True)
class KVShape:
    """The KV-cache geometry of a model.

    Attributes:
        name: the workload id.
        layers, kv_heads, head_dim: per-layer keys/values are ``[1, kv_heads, T, head_dim]``.
        window: sliding-window size of the sliding layers (None: none slide).
        global_every: with a window, every ``global_every``-th layer is global
            (Gemma 3's ``sliding_window_pattern``: layer ``i`` is global when
            ``i % global_every == global_every - 1``).
    """

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    window: int | None = None
    global_every: int = 1

    def is_sliding(self, layer: int) -> bool:
        """True if ``layer`` attends over a sliding window."""
        return self.window is not None and layer % self.global_every != self.global_every - 1

    @property
    def bytes_per_token(self) -> int:
        """bfloat16 keys and values of one token over every layer (BENCHMARKS.md's column)."""
        return self.layers * self.kv_heads * self.head_dim * 2 * _BF16_BYTES


#: BENCHMARKS.md "Workloads".
WORKLOADS: dict[str, KVShape] = {
    shape.name: shape
    for shape in (
        KVShape("llama8b", layers=32, kv_heads=8, head_dim=128),
        KVShape("qwen0.5b", layers=24, kv_heads=2, head_dim=64),
        KVShape("gemma-swa", layers=26, kv_heads=4, head_dim=256, window=1024, global_every=6),
    )
}


def windowed_signature(signature: str) -> str:
    """The sliding-window family storing rows like ``signature`` (``kv:quant:8:64`` ->
    ``kv:rotating-quant:8:64``); a windowed signature is returned as it is."""
    sig = parse_signature(signature)
    windowed = windowed_family(sig.kind)
    if windowed is None:
        raise ValueError(f"[bench] '{signature}' has no sliding-window family.")
    return windowed.signature(*sig.params)


@dataclass(frozen=True)
class SyntheticKV:
    """Seeded keys/values of ``shape`` for ``tokens`` tokens, built into caches on demand."""

    shape: KVShape
    tokens: int
    seed: int = 0

    @property
    def label(self) -> str:
        return f"{self.shape.name} {self.tokens}"

    def chunks(self, layer: int) -> list[tuple[mx.array, mx.array]]:
        """``(keys, values)`` of ``layer`` in prefill chunks; the same arrays for every call."""
        out = []
        for index, start in enumerate(range(0, self.tokens, PREFILL_STEP)):
            n = min(PREFILL_STEP, self.tokens - start)
            shape = (1, self.shape.kv_heads, n, self.shape.head_dim)
            keys, values = (_bf16_rows(shape, self._seed(layer, index, part)) for part in (0, 1))
            out.append((keys, values))
        return out

    def _seed(self, layer: int, chunk: int, part: int) -> int:
        return ((self.seed * 1000 + layer) * 1000 + chunk) * 2 + part

    def ours(self) -> list[Any]:
        """Our caches (``kvstore.caches``) after a chunked prefill, evaluated."""
        from kvstore.caches import KVCache, RotatingKVCache

        return self._prefill(KVCache, RotatingKVCache)

    def mlx_lm(self) -> list[Any]:
        """mlx-lm's caches (``mlx_lm.models.cache``) after the same prefill, evaluated."""
        from mlx_lm.models.cache import KVCache, RotatingKVCache

        return self._prefill(KVCache, RotatingKVCache)

    def _prefill(self, growing: Callable[[], Any], ring: Callable[..., Any]) -> list[Any]:
        caches = []
        for layer in range(self.shape.layers):
            sliding = self.shape.is_sliding(layer)
            cache = ring(max_size=self.shape.window) if sliding else growing()
            for keys, values in self.chunks(layer):
                cache.update_and_fetch(keys, values)
            mx.eval(cache_arrays([cache]))  # one layer at a time: peak memory stays one layer
            caches.append(cache)
        return caches


def _bf16_rows(shape: tuple[int, ...], seed: int) -> mx.array:
    """Seeded finite bfloat16 values in +-[1/8, 1/2): random sign, mantissa and lowest
    exponent bit. Random bits are ~10x quicker to make than normals on a CPU, and no
    figure depends on the values' distribution (sizes and copies do not)."""
    count = int(np.prod(shape))
    words = np.frombuffer(np.random.default_rng(seed).bytes(2 * count), dtype=np.uint16)
    words = (words & _KEEP_BITS) | _EXPONENT_BITS
    return mx.array(words.reshape(shape)).view(mx.bfloat16)


def synthetic_kv(workload: str, tokens: int, seed: int = 0) -> SyntheticKV:
    """The synthetic KV of ``workload`` (a key of :data:`WORKLOADS`) at ``tokens`` tokens."""
    if workload not in WORKLOADS:
        raise ValueError(f"[bench] Unknown workload '{workload}'; known: {', '.join(WORKLOADS)}.")
    if tokens <= 0:
        raise ValueError(f"[bench] A workload needs at least one token; received {tokens}.")
    return SyntheticKV(WORKLOADS[workload], tokens, seed)


def cache_arrays(caches: list[Any]) -> list[mx.array]:
    """Every array of the caches' ``state`` (what a save writes and a load must evaluate)."""
    leaves = cast(list[tuple[str, Any]], tree_flatten([c.state for c in caches]))
    return [a for _, a in leaves if isinstance(a, mx.array)]


def attended_arrays(caches: list[Any]) -> list[mx.array]:
    """What a restore or a load must have evaluated before the first forward: the rows
    below each cache's ``offset`` that attention reads (``keys_and_values``, ours and
    mlx-lm's; a cache without it, its ``state``). A restored cache's room past its rows
    is the steps' to write, and its ``state`` would zero that room first."""
    trees = [c.keys_and_values() if hasattr(c, "keys_and_values") else c.state for c in caches]
    leaves = cast(list[tuple[str, Any]], tree_flatten(trees))
    return [a for _, a in leaves if isinstance(a, mx.array)]


def cache_nbytes(caches: list[Any]) -> int:
    """Bytes of the caches' ``state`` arrays."""
    return sum(a.nbytes for a in cache_arrays(caches))


# -- the peers' cases ----------------------------------------------------------------------


def memcpy_case(nbytes: int, name: str = "memcpy") -> Case:
    """``numpy.copyto`` of ``nbytes`` into an already-touched buffer: the physical limit.

    Both buffers are anonymous maps of their own (page-aligned), not ``malloc``'s:
    the heap a restore's allocator setting keeps (:mod:`kvstore.codecs.host_memory`)
    hands out 16-byte-aligned blocks, and two of those 16 bytes apart copy at half
    the speed (256 MiB on the 2-core VM: 77 ms against 35), which would lower the
    limit the figures are held to.
    """
    source = np.frombuffer(mmap.mmap(-1, max(nbytes, 1)), dtype=np.uint8)[:nbytes]
    target = np.frombuffer(mmap.mmap(-1, max(nbytes, 1)), dtype=np.uint8)[:nbytes]
    source[:] = 1
    np.copyto(target, source)  # touch every page of both once
    return Case(name, "limit", lambda: np.copyto(target, source))


def mlx_lm_load_case(path: Path, name: str = "mlx-lm load") -> Case:
    """mlx-lm ``load_prompt_cache`` of ``path`` and ``mx.eval`` of every array it holds.

    The file is read once now, so the timed loads find it in the page cache.
    """
    from mlx_lm.models.cache import load_prompt_cache

    path.read_bytes()

    def load() -> list[Any]:
        caches = load_prompt_cache(str(path))
        mx.eval(cache_arrays(caches))
        return caches

    return Case(name, "peer", load)


def first_step(kv: SyntheticKV) -> Callable[[list[Any]], None]:
    """The first decode step after a restore or a load of ``kv``'s caches: one token
    through every layer's cache, evaluated. What a user waits for before the first
    generated token, beside the forward: MLX writes a token into a cache's room in place
    only when nothing else shares the array's buffer, and a cache without room grows, so
    this step may copy the whole cache (``fill.OWN_BUFFER_MIN_BYTES``)."""
    row = mx.ones((1, kv.shape.kv_heads, 1, kv.shape.head_dim), mx.bfloat16)
    mx.eval(row)

    def step(caches: list[Any]) -> None:
        mx.eval([c.update_and_fetch(row, row) for c in caches])

    return step


def with_first_step(case: Case, kv: SyntheticKV) -> Case:
    """``case`` (a restore or a load, returning its caches), then :func:`first_step`."""
    step = first_step(kv)

    def run() -> list[Any]:
        caches = cast(list[Any], case.run())
        step(caches)
        return caches

    return Case(f"{case.name} + step", case.role, run, reset=case.reset)


def mlx_lm_save_case(
    caches: list[Any], path: Path, *, durable: bool = False, name: str | None = None
) -> Case:
    """mlx-lm ``save_prompt_cache`` of ``caches`` to a fresh ``path`` (removed, untimed, before
    each call). ``durable`` adds an ``fsync`` of the file, what a committed store write pays."""
    from mlx_lm.models.cache import save_prompt_cache

    def save() -> None:
        save_prompt_cache(str(path), caches)
        if durable:
            fsync_path(path)  # what a committed store write pays beyond the write

    label = name or ("mlx-lm save+fsync" if durable else "mlx-lm save")
    return Case(label, "peer", save, reset=lambda: path.unlink(missing_ok=True))
