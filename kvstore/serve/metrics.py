"""``GET /metrics``: what the persistent prompt cache did, in Prometheus text format.

Every figure has the ``kvstore_`` prefix and lives in a registry of its own
(not prometheus-client's global one). Counters and histograms are fed by the
prompt cache's events (:class:`~kvstore.mlx_lm.FetchEvent`,
:class:`~kvstore.mlx_lm.SaveEvent`) and the server's time to first token; the
store's content (blocks, bytes) and the save queue are read when scraped.
Every miss reason is exported from the start (at 0), so a dashboard can
alert on ``kvstore_prompt_cache_misses_total{reason="unavailable"}`` before
the first one.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from kvstore.abc.store import MissReason
from kvstore.errors import KVStoreError
from kvstore.mlx_lm import IMAGE_PROMPT, NOT_PERSISTED, STORE_ERROR, FetchEvent, SaveEvent

if TYPE_CHECKING:
    from kvstore.mlx_lm import StorePromptCache

__all__ = ["ServeMetrics", "CONTENT_TYPE", "MISS_REASONS"]

log = logging.getLogger("kvstore.serve")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

#: Every reason a fetch reuses nothing for (the store's, then ours).
MISS_REASONS = (*MissReason.ALL, NOT_PERSISTED, IMAGE_PROMPT, STORE_ERROR)

_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class ServeMetrics:
    """The server's metrics; :meth:`observe` is a prompt-cache listener."""

    def __init__(self, prompt_cache: StorePromptCache) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.hits = Counter(
            "kvstore_prompt_cache_hits",
            "Prompts that reused cached KV, by where it came from",
            ["source"],
            registry=r,
        )
        self.misses = Counter(
            "kvstore_prompt_cache_misses",
            "Prompts that reused nothing, by reason",
            ["reason"],
            registry=r,
        )
        self.prompt_tokens = Counter("kvstore_prompt_tokens", "Prompt tokens looked up", registry=r)
        self.reused = Counter(
            "kvstore_reused_tokens",
            "Prompt tokens whose KV was reused, by source",
            ["source"],
            registry=r,
        )
        self.exact = Counter(
            "kvstore_exact_hits_guarded",
            "Exact prompt-cache hits left one token to the model (mlx-lm 0.32.2 would crash)",
            registry=r,
        )
        self.saves = Counter("kvstore_saves", "Saves written to the store", registry=r)
        self.save_errors = Counter(
            "kvstore_save_errors", "Saves that failed, by reason", ["reason"], registry=r
        )
        self.saved_bytes = Counter(
            "kvstore_saved_bytes", "Bytes of new blocks written to the store", registry=r
        )
        self.saved_blocks = Counter(
            "kvstore_saved_blocks", "New blocks written to the store", registry=r
        )
        self.deduplicated = Counter(
            "kvstore_deduplicated_blocks", "Blocks a save found stored already", registry=r
        )
        self.lookup_s = Histogram(
            "kvstore_lookup_seconds", "Store lookups", buckets=_SECONDS, registry=r
        )
        self.restore_s = Histogram(
            "kvstore_restore_seconds",
            "Store restores (caches rebuilt)",
            buckets=_SECONDS,
            registry=r,
        )
        self.save_s = Histogram(
            "kvstore_save_seconds",
            "Commits of the saves, on the store's writer thread (a group's, grouped)",
            buckets=_SECONDS,
            registry=r,
        )
        self.save_wait_s = Histogram(
            "kvstore_save_queue_wait_seconds",
            "Time a save waited for the writer thread",
            buckets=_SECONDS,
            registry=r,
        )
        self.handoff_s = Histogram(
            "kvstore_save_handoff_seconds",
            "Time the generating thread gave a save (what is held, copies scheduled, enqueued)",
            buckets=_SECONDS,
            registry=r,
        )
        self.ttft = Histogram(
            "kvstore_time_to_first_token_seconds",
            "From a request reaching the generator to its first token",
            buckets=_SECONDS,
            registry=r,
        )
        for source in ("memory", "store"):
            self.hits.labels(source)
            self.reused.labels(source)
        for reason in MISS_REASONS:
            self.misses.labels(reason)
        for reason in (MissReason.UNAVAILABLE, STORE_ERROR):
            self.save_errors.labels(reason)
        r.register(_Scraped(prompt_cache))

    def observe(self, event: FetchEvent | SaveEvent) -> None:
        """Count one prompt-cache event."""
        if isinstance(event, FetchEvent):
            self.prompt_tokens.inc(event.prompt_tokens)
            self.exact.inc(event.exact_hit)
            if event.source == "none":
                self.misses.labels(event.miss_reason or MissReason.COLD).inc()
            else:
                self.hits.labels(event.source).inc()
                self.reused.labels(event.source).inc(event.reused)
            if event.lookup_s:
                self.lookup_s.observe(event.lookup_s)
            if event.restore_s:
                self.restore_s.observe(event.restore_s)
            return
        self.save_wait_s.observe(event.waited_s)
        self.handoff_s.observe(event.handoff_s)
        if event.error is not None:
            self.save_errors.labels(event.reason or STORE_ERROR).inc()
            return
        self.saves.inc()
        self.save_s.observe(event.seconds)
        self.saved_bytes.inc(event.written_bytes)
        self.saved_blocks.inc(event.written_blocks)
        self.deduplicated.inc(event.deduplicated)

    def exposition(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)


class _Scraped(Collector):
    """Figures read when scraped: the store's content and the save queue."""

    def __init__(self, prompt_cache: StorePromptCache) -> None:
        self.prompt_cache = prompt_cache

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        store = self.prompt_cache.store
        up = GaugeMetricFamily("kvstore_store_up", "1 when the store answered this scrape")
        blocks = GaugeMetricFamily("kvstore_store_blocks", "Blocks the store holds")
        size = GaugeMetricFamily("kvstore_store_bytes", "Bytes the store holds")
        try:
            stats = store.stats()
        except KVStoreError as exc:
            log.debug("kvstore: store stats unavailable for /metrics: %s", exc)
            up.add_metric([], 0)
        else:
            up.add_metric([], 1)
            blocks.add_metric([], stats.blocks)
            size.add_metric([], stats.bytes)
        yield from (up, blocks, size)
        writer = self.prompt_cache.stats()["writer"]
        pending = GaugeMetricFamily("kvstore_save_queue_depth", "Saves waiting for the writer")
        pending.add_metric([], writer["pending"])
        yield pending
        dropped = GaugeMetricFamily(
            "kvstore_saves_dropped", "Saves dropped because the save queue was full"
        )
        dropped.add_metric([], writer["dropped"])
        yield dropped
        memory = GaugeMetricFamily(
            "kvstore_memory_cache_bytes", "Bytes in mlx-lm's in-memory prompt cache"
        )
        memory.add_metric([], int(self.prompt_cache.nbytes))
        yield memory
