"""Spreading one thread's MLX CPU work over the cores, a block per stream.

MLX runs each stream's CPU work on that stream's own thread, one core, in order
(a ``mx.quantize`` of one layer's keys and values takes 32 ms on one stream here,
16 ms split over two). Work cut into independent blocks -- TurboQuant's encode and
decode, which walk a layer in cache-sized blocks -- can run a block on each core:
:func:`evaluated_in_waves` builds the blocks on this thread's CPU streams in turn
and evaluates one wave of them at a time (a wave finishes before the next is built,
so each block's passes still run while it is in cache).

Streams belong to the thread that made them (MLX 0.31.2 on: evaluating on another
thread's stream raises "There is no Stream(cpu, N) in current thread"), and each
thread already has its own default stream; so each thread gets its own extra ones
here, made at its first spread and kept, as MLX keeps its default ones.
``KVSTORE_CPU_STREAMS`` sets how many streams a thread spreads over (default: the
machine's cores, at most 8); 1 keeps all work on the default stream.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import mlx.core as mx

from kvstore.knobs import count_from_env
from kvstore.threads import cores

__all__ = ["cpu_streams", "evaluated_in_waves", "spread", "stream_count"]

T = TypeVar("T")
#: More streams than this gains little (blocks are ~1 MiB) and holds more blocks at once.
MAX_STREAMS = 8

_local = threading.local()


def stream_count() -> int:
    """How many CPU streams a thread spreads its blocks over."""
    default = min(MAX_STREAMS, cores())
    return count_from_env("KVSTORE_CPU_STREAMS", default, "streams")


def cpu_streams() -> list[mx.Stream]:
    """This thread's CPU streams: its default one first, then its extra ones.

    The default one as it was at the thread's first call: inside :func:`spread`'s
    context MLX's default stream is one of the extra ones, and waves built there
    (a TurboQuant decode in a spread block) would put two items on one stream."""
    count = stream_count()
    base: mx.Stream | None = getattr(_local, "base", None)
    if base is None:
        base = _local.base = mx.default_stream(mx.cpu)
    extra: list[mx.Stream] = getattr(_local, "extra", [])
    while len(extra) < count - 1:
        extra.append(mx.new_stream(mx.cpu))
    _local.extra = extra
    return [base, *extra[: count - 1]]


def evaluated_in_waves(items: Sequence[T], build: Callable[[T], Any]) -> list[Any]:
    """``[build(item) for item in items]``, every result evaluated.

    On the CPU, consecutive items are built on this thread's CPU streams in turn (a wave
    of one item per stream) and each wave is evaluated before the next is built. On a
    GPU every item is built, then all are evaluated at once: one host round trip.
    """
    if mx.default_device() != mx.cpu:
        built = [build(item) for item in items]
        mx.eval(built)
        return built
    streams = cpu_streams() if len(items) > 1 else [mx.default_stream(mx.cpu)]
    results: list[Any] = []
    for first in range(0, len(items), len(streams)):
        wave = []
        for stream, item in zip(streams, items[first : first + len(streams)]):
            with mx.stream(stream):
                wave.append(build(item))
        mx.eval(wave)
        results.extend(wave)
    return results


@contextlib.contextmanager
def spread(index: int) -> Iterator[None]:
    """Build what follows on this thread's CPU stream ``index`` (modulo their count), so
    that one evaluation of many independent items runs them on every core, a stream's
    items on its own thread. On a GPU, or with one stream, it changes nothing.

    For work that cannot be cut into cache-sized waves but comes in independent items: a
    lossy storage policy's per-layer ``mx.quantize`` at a save and ``mx.dequantize`` at
    a restore, which MLX's CPU backend runs at ~0.5-0.9 GB/s on one core. What is built
    here must be evaluated on this thread (the streams are its own)."""
    if mx.default_device() != mx.cpu:
        yield
        return
    streams = cpu_streams()
    if len(streams) == 1:
        yield
        return
    with mx.stream(streams[index % len(streams)]):
        yield
