"""Row-batched caches: mlx-lm's batch protocol for our families, written once over row trees.

mlx-lm's ``BatchGenerator`` batches sequences by merging their caches
(``caches[0].merge(caches)``) into one cache of ``B`` left-padded rows, then
calls ``update_and_fetch``, ``make_mask``, ``prepare``/``finalize`` (right padding
during a prefill step), ``filter`` (rows that finished), ``extend`` (rows that
joined) and ``extract(row)`` (one row back as a single-sequence cache, e.g. to
keep or store it). mlx-lm implements that for raw rows only (``BatchKVCache``,
``BatchRotatingKVCache``); quantized caches cannot batch there, and its server
turns batching off under ``--kv-bits``.

Here the same arithmetic (step by step mlx-lm's, so a batch row attends to
exactly what it does in mlx-lm) runs over row *trees* (:mod:`kvstore.caches.base`):
a bare array for raw rows, ``(packed, scales, biases)`` for affine rows. So
each of our growing and windowed families batches, raw and affine:

===========================================  ======================================
batch class                                  signature
===========================================  ======================================
:class:`BatchKVCache`                        ``batch:kv:plain``
:class:`BatchQuantizedKVCache`               ``batch:kv:quant:{bits}:{group}``
:class:`BatchRotatingKVCache`                ``batch:kv:rotating-plain``
:class:`BatchRotatingQuantizedKVCache`       ``batch:kv:rotating-quant:{bits}:{group}``
===========================================  ======================================

A batch cache reports ``batch:`` plus its rows' family (the ``batch`` wrapper
family, :data:`BATCH_FAMILY`, registered with the built-ins: its state is no
single sequence's keys and values, so every predicate fails closed on it, and a
batch of a family no batch class serves does not exist); ``extract`` gives back
a cache of that family (which the store persists as any other), and ``merge``
of single caches (:func:`~kvstore.caches.base.merge_caches`, which our single caches' ``merge``
calls) admits restored caches into a running batch. Windows batch with
``keep == 0`` (mlx-lm's batch ring has no sink tokens); TurboQuant caches do
not batch yet (they have no ``merge``, so mlx-lm serves them one at a time).
"""

from kvstore.caches.base import batch_class_for, merge_caches, register_batch_class
from kvstore.caches.batch.growing import BatchKVCache, BatchQuantizedKVCache
from kvstore.caches.batch.ring import BatchRotatingKVCache, BatchRotatingQuantizedKVCache
from kvstore.caches.batch.rows import BATCH_FAMILY

__all__ = [
    "BATCH_FAMILY",
    "BatchKVCache",
    "BatchQuantizedKVCache",
    "BatchRotatingKVCache",
    "BatchRotatingQuantizedKVCache",
    "merge_caches",
    "batch_class_for",
]

for _cls in (
    BatchKVCache,
    BatchQuantizedKVCache,
    BatchRotatingKVCache,
    BatchRotatingQuantizedKVCache,
):
    register_batch_class(_cls)
