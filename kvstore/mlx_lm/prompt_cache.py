"""A prompt cache for mlx-lm with a prefix store behind its in-memory LRU.

:class:`StorePromptCache` is mlx-lm 0.32's ``LRUPromptCache`` (a subclass: the
same ``fetch_nearest_cache``/``insert_cache``/``trim_to``/``stats_by_type``, so
``mlx_lm.server`` takes it as it is), with a prefix store behind it:

* ``fetch_nearest_cache(model_key, tokens)`` asks the memory LRU, then the
  store, and returns whichever reuses more; a store hit is rebuilt in
  mlx-lm's own cache classes (:mod:`kvstore.mlx_lm.families`). The remainder is
  never empty: mlx-lm 0.32.2 returns ``(cache, [])`` on an exact hit, which
  kills the server's generation thread (``Sequence 1 has an empty prompt``);
  here the cache is trimmed by one token (or not used, when it cannot be).
* ``insert_cache(model_key, tokens, caches)`` keeps the caches in memory and
  hands a save of exactly those tokens to the store's own writer thread
  (``store.save_behind``: the new rows copied, committed in the background
  under the store's ``durability``); at most ``max_pending`` saves wait for
  it, a save beyond them is dropped (counted and logged) rather than held.

For ``stream_generate`` users, :meth:`StorePromptCache.fetch` and
:meth:`StorePromptCache.insert` are the same in mlx-lm's terms::

    caches, rest = prompt_cache.fetch(prompt)       # rest: never empty
    for r in stream_generate(model, tokenizer, rest, prompt_cache=caches): ...
    prompt_cache.insert(prompt + generated, caches) # exactly the tokens with KV

Feed ``rest``, not the whole prompt: mlx-lm appends whatever it is given to the
cache, so the whole prompt with a restored cache holds the prefix twice (and
generates from garbage). :meth:`~StorePromptCache.insert` refuses caches whose
token count does not match, which is where that mistake shows.

The store is a cache: a lookup, restore or save that fails is a miss (or a
skipped save), logged and counted, never an error of the request. Families
the store cannot persist yet (hybrid models' recurrent state, image prompts,
a draft model's caches) keep mlx-lm's behaviour; :meth:`StorePromptCache.stats`
says why for each.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import (
    LRUPromptCache,
    can_trim_prompt_cache,
    make_prompt_cache,
    trim_prompt_cache,
)

from kvstore.abc.store import MissReason, PrefixStore, SaveHandle
from kvstore.bridge.namespace import DEFAULT_QUANTIZED_KV_START, namespace_for_mlx_lm
from kvstore.bridge.session import STORE_FAULTS
from kvstore.errors import CapabilityError, StoreUnavailableError
from kvstore.mlx_lm.binding import Binding
from kvstore.mlx_lm.capture import captured_blocks
from kvstore.mlx_lm.events import (
    IMAGE_PROMPT,
    NOT_PERSISTED,
    QUEUE_FULL,
    STORE_ERROR,
    FetchEvent,
    SaveEvent,
)
from kvstore.mlx_lm.families import (
    as_mlx_lm_caches,
    held_tokens,
    not_persisted,
    token_ids,
    with_capture,
)
from kvstore.mlx_lm.version import check_mlx_lm_version

__all__ = ["StorePromptCache", "DEFAULT_KEY"]

log = logging.getLogger("kvstore.mlx_lm")

#: The model key :meth:`StorePromptCache.fetch`/``insert`` use (mlx-lm's server uses its own).
DEFAULT_KEY = "default"


@dataclass
class _Counters:
    fetches: int = 0
    hits: Counter[str] = field(default_factory=Counter)
    misses: Counter[str] = field(default_factory=Counter)
    reused_tokens: Counter[str] = field(default_factory=Counter)
    prompt_tokens: int = 0
    exact_hits: int = 0
    inserts: Counter[str] = field(default_factory=Counter)
    saves: int = 0
    saves_skipped: Counter[str] = field(default_factory=Counter)
    save_errors: Counter[str] = field(default_factory=Counter)
    saved_blocks: int = 0
    saved_bytes: int = 0
    deduplicated_blocks: int = 0
    pending_saves: int = 0


class StorePromptCache(LRUPromptCache):  # type: ignore[misc]  # mlx-lm is untyped
    """mlx-lm's ``LRUPromptCache`` with a prefix store behind it (module docstring).

    Args:
        store: a prefix store (:func:`kvstore.store.open_store`).
        model: the mlx-lm model (``mlx_lm.load(path)[0]``) or its directory, bound
            to :meth:`fetch`/:meth:`insert`; a server binds its own with :meth:`bind`.
        source: the directory ``model`` was loaded from unchanged (its namespace
            is then read from the digest cache instead of hashed from memory).
        adapter_path: the adapters ``mlx_lm.load(..., adapter_path=)`` applied.
        kv_bits, kv_group_size, quantized_kv_start: the KV quantization the
            generation uses (``stream_generate``/``mlx_lm.server`` options).
        tenant: a salt keeping tenants of a shared store apart.
        max_size, max_bytes: the in-memory LRU's bounds (mlx-lm's).
        max_pending: saves handed to the store's writer and not committed, at
            most; one beyond them is dropped (the store cannot keep up).

    Raises:
        CapabilityError: mlx-lm outside the tested range, or ``store`` is not a
            prefix store.
    """

    def __init__(
        self,
        store: PrefixStore,
        model: Any = None,
        *,
        source: str | None = None,
        adapter_path: str | None = None,
        kv_bits: int | None = None,
        kv_group_size: int = 64,
        quantized_kv_start: int = DEFAULT_QUANTIZED_KV_START,
        tenant: str | None = None,
        max_size: int = 10,
        max_bytes: int = 1 << 63,
        max_pending: int = 32,
    ) -> None:
        check_mlx_lm_version("StorePromptCache")
        if not isinstance(store, PrefixStore):
            raise CapabilityError(
                f"[StorePromptCache] store takes a prefix store "
                f"(kvstore.store.open_store(url)); received {type(store).__name__}.",
                found=type(store).__name__,
            )
        super().__init__(max_size=max_size, max_bytes=max_bytes)
        self.store = store
        self.kv_bits = kv_bits
        self.kv_group_size = kv_group_size
        self.quantized_kv_start = quantized_kv_start
        self.tenant = tenant
        self.max_pending = max_pending
        self._bindings: dict[Hashable, Binding] = {}
        self._counters = _Counters()
        self._lock = threading.Lock()
        self._listeners: list[Callable[[FetchEvent | SaveEvent], None]] = []
        self._said_images = False
        if model is not None:
            self.bind(DEFAULT_KEY, model, source=source, adapter_path=adapter_path)

    # ------------------------------------------------------------------ binding

    def bind(
        self,
        model_key: Hashable,
        model: Any,
        *,
        source: str | None = None,
        adapter_path: str | None = None,
        draft_model: Any = None,
    ) -> Binding:
        """Serve ``model`` under ``model_key`` (mlx-lm's server keys models by
        ``(path, adapter, draft)``); returns what the store keeps of it.

        Raises:
            StoreConfigError, CapabilityError: a model kvstore cannot name.
        """
        obj = model
        if not hasattr(model, "parameters"):  # a directory: load it as mlx-lm does
            from mlx_lm.utils import load as mlx_lm_load

            obj = mlx_lm_load(str(model), adapter_path=adapter_path)[0]
            source = str(model) if source is None else source
        templates = make_prompt_cache(obj)
        why = not_persisted(templates)
        if draft_model is not None:
            why["draft model"] = (
                "speculative decoding (a draft model's caches beside the model's) is not "
                "persisted yet"
            )
        namespace = None
        if not why:
            namespace = namespace_for_mlx_lm(
                obj,
                source=source,
                adapter_path=adapter_path if source is not None else None,
                caches=templates,
                kv_bits=self.kv_bits,
                kv_group_size=self.kv_group_size,
                quantized_kv_start=self.quantized_kv_start,
                tenant=self.tenant,
            )
        binding = Binding(
            model_key,
            obj,
            namespace,
            why,
            self.store.block_size,
            self.kv_bits,
            self.kv_group_size,
            self.quantized_kv_start,
        )
        self._bindings[model_key] = binding
        if why:
            log.warning(
                "kvstore: %s stays in memory only (mlx-lm's prompt cache): %s",
                model_key,
                "; ".join(f"{k}: {v}" for k, v in why.items()),
            )
        else:
            log.info("kvstore: %s persisted in %s, namespace %s", model_key, self.store, namespace)
        return binding

    def binding(self, model_key: Hashable = DEFAULT_KEY) -> Binding | None:
        return self._bindings.get(model_key)

    def add_listener(self, listener: Callable[[FetchEvent | SaveEvent], None]) -> None:
        """Call ``listener(event)`` after each fetch and each save (metrics)."""
        self._listeners.append(listener)

    # ------------------------------------------------------------ mlx-lm's terms

    def fetch(self, tokens: Any) -> tuple[list[Any], list[int]]:
        """The caches of the longest known prefix of ``tokens`` and the tokens left.

        Returns:
            ``(caches, rest)``: caches ready for ``stream_generate(...,
            prompt_cache=caches)`` and ``BatchGenerator``, holding
            ``len(tokens) - len(rest)`` tokens (fresh ones when nothing is known);
            ``rest`` is never empty. Feed ``rest``, not ``tokens``.

        Raises:
            ValueError: an empty prompt, or no model bound.
        """
        toks = token_ids(tokens, "fetch")
        binding = self._require_binding("fetch")
        caches, rest = self.fetch_nearest_cache(DEFAULT_KEY, toks)
        return (binding.fresh() if caches is None else caches), rest

    def insert(self, tokens: Any, caches: Sequence[Any], *, cache_type: str = "assistant") -> None:
        """Keep ``caches``, which hold the KV of exactly ``tokens``, and store them.

        Raises:
            ValueError: the caches hold KV for a different number of tokens (the
                message says how to feed a restored cache).
        """
        toks = token_ids(tokens, "insert")
        self._require_binding("insert")
        held = held_tokens(caches)
        if held is not None and held != len(toks):
            extra = held - len(toks)
            hint = (
                f"they hold {extra} more: if caches came from fetch(), feed only `rest` to "
                f"the model; the whole prompt puts the restored prefix in the cache twice"
                if extra > 0
                else "pass only the tokens the caches hold (the prompt and the generated "
                "tokens fed back to the model)"
            )
            raise ValueError(
                f"[insert] The caches hold KV for {held} tokens but {len(toks)} tokens were "
                f"given; {hint}."
            )
        self.insert_cache(DEFAULT_KEY, toks, list(caches), cache_type=cache_type)

    def flush(self) -> None:
        """Wait until every save handed to the store's writer is committed."""
        self.store.flush()

    # ------------------------------------------------------------- the server seam

    def fetch_nearest_cache(self, model: Hashable, tokens: list[int]) -> tuple[Any, list[int]]:
        """mlx-lm's ``fetch_nearest_cache`` with the store behind it; the remainder is
        never empty (module docstring). Never raises for a store fault."""
        tokens = list(tokens)
        cache, rest = super().fetch_nearest_cache(model, tokens)
        exact = cache is not None and not rest
        if exact:  # mlx-lm 0.32.2's server dies on an empty remainder
            if len(tokens) > 1 and can_trim_prompt_cache(cache) and trim_prompt_cache(cache, 1):
                rest = tokens[-1:]
            else:
                cache, rest = None, tokens
        memory = len(tokens) - len(rest)
        binding = self._bindings.get(model)
        reason = self._why_not(binding, tokens)
        lookup_s = restore_s = 0.0
        source = "memory" if memory else "none"
        if reason is None:
            assert binding is not None and binding.namespace is not None
            restored, reason, lookup_s, restore_s = self._from_store(binding, tokens, memory)
            if restored is not None:
                cache, source = restored, "store"
                rest = tokens[int(restored[0].offset) :]
            elif cache is None:  # fresh caches that capture what the store needs later
                cache = binding.fresh()
            else:  # memory's copy (a batch row extracted by mlx-lm, say): capture from here on
                cache = with_capture(cache, binding.block_size)
        elif reason == IMAGE_PROMPT and not self._said_images:
            self._said_images = True
            log.info("kvstore: prompts with images stay in mlx-lm's in-memory prompt cache")
        reused = len(tokens) - len(rest)
        event = FetchEvent(
            model,
            len(tokens),
            reused,
            source,
            None if source == "memory" else reason,
            lookup_s,
            restore_s,
            exact,
        )
        with self._lock:
            c = self._counters
            c.fetches += 1
            c.prompt_tokens += len(tokens)
            c.exact_hits += exact
            if source == "none":
                c.misses[event.miss_reason or MissReason.COLD] += 1
            else:
                c.hits[source] += 1
                c.reused_tokens[source] += reused
        self._emit(event)
        return cache, rest

    def insert_cache(
        self,
        model: Hashable,
        tokens: list[int],
        prompt_cache: list[Any],
        *,
        cache_type: str = "assistant",
    ) -> None:
        """mlx-lm's ``insert_cache``, and a save of ``tokens`` handed to the store's writer."""
        super().insert_cache(model, tokens, prompt_cache, cache_type=cache_type)
        with self._lock:
            self._counters.inserts[cache_type] += 1
        binding = self._bindings.get(model)
        reason = self._why_not(binding, tokens)
        if reason is None and self.store.read_only:
            reason = "read_only"
        if reason is not None:
            with self._lock:
                self._counters.saves_skipped[reason] += 1
            return
        assert binding is not None and binding.namespace is not None
        entered = time.perf_counter()
        held = held_tokens(prompt_cache)
        count = len(tokens) if held is None else min(held, len(tokens))
        if count < 1:
            return
        namespace = binding.namespace
        with self._lock:
            full = self._counters.pending_saves >= self.max_pending
            if full:
                self._counters.saves_skipped[QUEUE_FULL] += 1
            else:
                self._counters.pending_saves += 1
        if full:
            log.warning(
                "kvstore: %d saves wait for the store's writer; a save was dropped",
                self.max_pending,
            )
            return
        toks = list(tokens[:count])
        caches = list(prompt_cache)
        captured = captured_blocks(caches)
        # The writer thread waits for arrays scheduled here (it cannot evaluate a lazy
        # graph of this thread's); save_behind schedules its copies of the new rows too.
        mx.async_eval([s.tensors for s in captured.values()])
        try:
            handle = self.store.save_behind(namespace, toks, caches, captured=captured)
        except STORE_FAULTS as exc:  # the hand-off asks the store what it holds (Redis gone)
            held_s = time.perf_counter() - entered
            with self._lock:
                self._counters.pending_saves -= 1
            self._save_failed(namespace, len(toks), exc, held_s)
            return
        held_s = time.perf_counter() - entered  # what the caller's (generating) thread gave
        handle.add_done_callback(lambda done: self._saved(done, len(toks), held_s))

    # ------------------------------------------------------------------ reports

    def stats(self) -> dict[str, Any]:
        """What the prompt cache did and holds, JSON-able (``/v1/kvstore/stats``)."""
        with self._lock:
            c = self._counters
            counters = {
                "fetches": c.fetches,
                "prompt_tokens": c.prompt_tokens,
                "hits": dict(c.hits),
                "misses": dict(c.misses),
                "reused_tokens": dict(c.reused_tokens),
                "exact_hits_guarded": c.exact_hits,
                "inserts": dict(c.inserts),
                "saves": c.saves,
                "saves_skipped": dict(c.saves_skipped),
                "save_errors": dict(c.save_errors),
                "saved_blocks": c.saved_blocks,
                "saved_bytes": c.saved_bytes,
                "deduplicated_blocks": c.deduplicated_blocks,
            }
            writer = {  # the store's writer, as this prompt cache uses it
                "pending": c.pending_saves,
                "written": c.saves,
                "failed": sum(c.save_errors.values()),
                "dropped": c.saves_skipped.get(QUEUE_FULL, 0),
                "capacity": self.max_pending,
                "durability": getattr(self.store, "durability", None),
            }
        models = {
            _key_label(key): {
                "persisted": b.namespace is not None,
                "namespace": b.namespace,
                "not_persisted": dict(b.not_persisted),
                "kv_bits": b.kv_bits,
            }
            for key, b in self._bindings.items()
        }
        return {
            "store": {"url": self.store.url, "block_size": self.store.block_size},
            "writer": writer,
            "models": models,
            "memory_only": {
                IMAGE_PROMPT: "prompts with images are keyed by image ids, not tokens; "
                "they stay in mlx-lm's in-memory prompt cache",
            },
            "prompt_cache": counters,
            "memory": {
                "sequences": len(self),
                "bytes": int(self.nbytes),
                "by_type": self.stats_by_type(),
            },
            "store_activity": self.store.activity(),
        }

    # ------------------------------------------------------------------ internals

    def _require_binding(self, operation: str) -> Binding:
        binding = self._bindings.get(DEFAULT_KEY)
        if binding is None:
            raise ValueError(
                f"[{operation}] No model is bound: pass model= to StorePromptCache (an mlx-lm "
                f"model or its directory)."
            )
        return binding

    def _why_not(self, binding: Binding | None, tokens: Sequence[int]) -> str | None:
        if binding is None or binding.namespace is None:
            return NOT_PERSISTED
        if tokens and min(tokens) < 0:  # mlx-lm's server keys image prompts by negative ids
            return IMAGE_PROMPT
        return None

    def _from_store(
        self, binding: Binding, tokens: list[int], memory: int
    ) -> tuple[list[Any] | None, str | None, float, float]:
        """``(caches, miss reason, lookup_s, restore_s)``: caches only if they reuse
        more than ``memory`` tokens."""
        assert binding.namespace is not None
        store = self.store
        before = _misses(store)
        lookup_s = restore_s = 0.0
        t0 = time.perf_counter()
        try:
            match = store.lookup(binding.namespace, tokens)
            t1 = time.perf_counter()
            lookup_s = t1 - t0
            if match.tokens <= memory:
                return None, _new_miss(store, before), lookup_s, 0.0
            restored = store.restore(match, binding.templates(match.tokens))
            restore_s = time.perf_counter() - t1
        except STORE_FAULTS as exc:
            reason = (
                MissReason.UNAVAILABLE
                if isinstance(exc, StoreUnavailableError)
                else _new_miss(store, before) or STORE_ERROR
            )
            log.warning("kvstore: the store served nothing (%s): %s", reason, exc)
            return None, reason, lookup_s, restore_s
        held = int(restored[0].offset) if restored else 0
        if held <= memory:
            return None, _new_miss(store, before) or MissReason.VANISHED, lookup_s, restore_s
        caches = as_mlx_lm_caches(restored, binding.block_size)
        return caches, None, lookup_s, restore_s

    def _saved(self, handle: SaveHandle, tokens: int, held_s: float) -> None:
        """A save handed off is done (the store's writer thread calls this)."""
        with self._lock:
            self._counters.pending_saves -= 1
        try:
            result = handle.result(timeout=0)
        except STORE_FAULTS as exc:
            self._save_failed(
                handle.namespace, tokens, exc, held_s, handle.commit_s, handle.queued_s
            )
            return
        event = SaveEvent(
            handle.namespace,
            tokens,
            len(result.written),
            result.written_bytes,
            result.deduplicated,
            handle.commit_s,
            handle.queued_s,
            held_s,
        )
        with self._lock:
            c = self._counters
            c.saves += 1
            c.saved_blocks += event.written_blocks
            c.saved_bytes += event.written_bytes
            c.deduplicated_blocks += event.deduplicated
        self._emit(event)

    def _save_failed(
        self,
        namespace: str,
        tokens: int,
        exc: Exception,
        held_s: float,
        seconds: float = 0.0,
        waited_s: float = 0.0,
    ) -> None:
        unavailable = isinstance(exc, StoreUnavailableError)
        reason = MissReason.UNAVAILABLE if unavailable else STORE_ERROR
        log.warning("kvstore: a save failed (%s; generation unaffected): %s", reason, exc)
        with self._lock:
            self._counters.save_errors[reason] += 1
        self._emit(
            SaveEvent(
                namespace,
                tokens,
                seconds=seconds,
                waited_s=waited_s,
                handoff_s=held_s,
                error=f"{type(exc).__name__}: {exc}",
                reason=reason,
            )
        )

    def _emit(self, event: FetchEvent | SaveEvent) -> None:
        for listener in self._listeners:
            try:
                listener(event)
            except Exception:  # a metrics bug must not fail a request
                log.exception("kvstore: a prompt-cache listener failed")


def _misses(store: PrefixStore) -> dict[str, int]:
    return dict(store.activity().get("misses", {}))


def _new_miss(store: PrefixStore, before: dict[str, int]) -> str | None:
    """The miss reason the store counted since ``before`` (``None`` if none)."""
    after = _misses(store)
    for reason, count in after.items():
        if count > before.get(reason, 0):
            return reason
    return None


def _key_label(key: Hashable) -> str:
    if isinstance(key, tuple):
        return " ".join(f"{v}" for v in key if v is not None) or "default"
    return str(key)
