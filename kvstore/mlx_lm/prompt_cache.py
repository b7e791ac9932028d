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
  hands a save of exactly those tokens to the writer (``writer=``; inline when
  none is given, a background thread in ``kvstore serve``).

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
from typing import Any, Protocol

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import (
    KVCache,
    LRUPromptCache,
    RotatingKVCache,
    can_trim_prompt_cache,
    make_prompt_cache,
    trim_prompt_cache,
)

from kvstore.abc.store import MissReason, PrefixStore
from kvstore.bridge.namespace import DEFAULT_QUANTIZED_KV_START, namespace_for_mlx_lm
from kvstore.bridge.session import STORE_FAULTS
from kvstore.caches import QuantizedKVCache, RotatingQuantizedKVCache
from kvstore.errors import CapabilityError, StoreUnavailableError
from kvstore.mlx_lm.capture import captured_blocks
from kvstore.mlx_lm.families import as_mlx_lm_caches, not_persisted, with_capture
from kvstore.mlx_lm.version import check_mlx_lm_version

__all__ = [
    "StorePromptCache",
    "Binding",
    "FetchEvent",
    "SaveEvent",
    "Writer",
    "InlineWriter",
    "NOT_PERSISTED",
    "IMAGE_PROMPT",
    "STORE_ERROR",
]

log = logging.getLogger("kvstore.mlx_lm")

#: Miss reasons of our own, beside the store's :class:`~kvstore.abc.store.MissReason`.
NOT_PERSISTED = "not_persisted"  # the model's cache families stay in memory
IMAGE_PROMPT = "image_prompt"  # a prompt with images: its key holds image ids, not tokens
STORE_ERROR = "store_error"  # any other store fault (a full store, a codec missing...)

#: The model key :meth:`StorePromptCache.fetch`/``insert`` use (mlx-lm's server uses its own).
DEFAULT_KEY = "default"


class Writer(Protocol):
    """Where saves go: ``submit(job)`` runs ``job()`` now or later; ``flush()`` waits."""

    def submit(self, job: Callable[[], None]) -> None: ...

    def flush(self, timeout: float | None = None) -> bool: ...


class InlineWriter:
    """Runs each save on the calling thread, at once."""

    def submit(self, job: Callable[[], None]) -> None:
        job()

    def flush(self, timeout: float | None = None) -> bool:
        return True


@dataclass(frozen=True)
class FetchEvent:
    """What one fetch did.

    Attributes:
        source: ``"memory"``, ``"store"`` or ``"none"`` (nothing reused).
        reused: prompt tokens whose KV came from ``source``.
        miss_reason: why the store served nothing (a ``MissReason`` value,
            :data:`NOT_PERSISTED`, :data:`IMAGE_PROMPT`, :data:`STORE_ERROR`), or
            ``None`` when it was not asked or had nothing better than memory.
        exact_hit: the memory LRU held the whole prompt (trimmed by one token).
    """

    model_key: Hashable
    prompt_tokens: int
    reused: int
    source: str
    miss_reason: str | None = None
    lookup_s: float = 0.0
    restore_s: float = 0.0
    exact_hit: bool = False


@dataclass(frozen=True)
class SaveEvent:
    """What one save did (``error`` set when it failed; nothing is raised)."""

    namespace: str
    tokens: int
    written_blocks: int = 0
    written_bytes: int = 0
    deduplicated: int = 0
    seconds: float = 0.0
    waited_s: float = 0.0
    error: str | None = None
    reason: str | None = None


@dataclass
class Binding:
    """A model the prompt cache serves, and what the store keeps of it.

    Attributes:
        namespace: its store namespace, or ``None`` when nothing is persisted.
        not_persisted: why not, per cache family (empty when persisted).
    """

    model_key: Hashable
    model: Any
    namespace: str | None
    not_persisted: dict[str, str]
    block_size: int = 256
    kv_bits: int | None = None
    kv_group_size: int = 64
    quantized_kv_start: int = DEFAULT_QUANTIZED_KV_START

    @property
    def quantizes_from_start(self) -> bool:
        """``kv_bits`` from the first token (``quantized_kv_start`` 0) on a persisted
        model: every layer is one of our affine families, which batch (mlx-lm's
        ``QuantizedKVCache`` does not, so its server serves ``kv_bits`` one at a time)."""
        return self.kv_bits is not None and self.quantized_kv_start <= 0 and bool(self.namespace)

    def fresh(self) -> list[Any]:
        """Fresh caches: ``make_prompt_cache(model)``, affine from the start when
        :attr:`quantizes_from_start`, sliding windows capturing their blocks."""
        caches = make_prompt_cache(self.model)
        if self.namespace is None:
            return caches
        if self.quantizes_from_start:
            caches = self._affine(caches, windows=True)
        return with_capture(caches, self.block_size)

    def templates(self, tokens: int) -> list[Any]:
        """Fresh caches of the families a prefix of ``tokens`` tokens is held in.

        With ``kv_bits``, mlx-lm's generation quantizes a plain ``KVCache`` once it
        holds ``quantized_kv_start`` tokens, so a prefix that long is restored
        affine (windows too when quantizing from the start).
        """
        caches = make_prompt_cache(self.model)
        if self.kv_bits is None or tokens < self.quantized_kv_start:
            return caches
        return self._affine(caches, windows=self.quantizes_from_start)

    def _affine(self, caches: list[Any], *, windows: bool) -> list[Any]:
        assert self.kv_bits is not None
        group, bits = self.kv_group_size, self.kv_bits
        out: list[Any] = []
        for c in caches:
            if type(c) is KVCache:
                out.append(QuantizedKVCache(group_size=group, bits=bits))
            elif windows and type(c) is RotatingKVCache:
                out.append(RotatingQuantizedKVCache(int(c.max_size), int(c.keep), group, bits))
            else:
                out.append(c)
        return out


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
        writer: where saves run (:class:`Writer`); default: inline.

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
        writer: Writer | None = None,
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
        self.writer: Writer = writer if writer is not None else InlineWriter()
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
        toks = _as_token_list(tokens, "fetch")
        binding = self._require_binding("fetch")
        caches, rest = self.fetch_nearest_cache(DEFAULT_KEY, toks)
        return (binding.fresh() if caches is None else caches), rest

    def insert(self, tokens: Any, caches: Sequence[Any], *, cache_type: str = "assistant") -> None:
        """Keep ``caches``, which hold the KV of exactly ``tokens``, and store them.

        Raises:
            ValueError: the caches hold KV for a different number of tokens (the
                message says how to feed a restored cache).
        """
        toks = _as_token_list(tokens, "insert")
        self._require_binding("insert")
        held = _held(caches)
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

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every save handed to the writer is written."""
        return self.writer.flush(timeout)

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
        """mlx-lm's ``insert_cache``, and a save of ``tokens`` handed to the writer."""
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
        held = _held(prompt_cache)
        count = len(tokens) if held is None else min(held, len(tokens))
        if count < 1:
            return
        toks = list(tokens[:count])
        caches = list(prompt_cache)
        captured = captured_blocks(caches)
        # A lazy array cannot be evaluated on another thread: materialise it here
        # (the arrays are computed already; this only settles the graph).
        mx.eval([c.state for c in caches])
        handed = time.perf_counter()
        namespace = binding.namespace
        self.writer.submit(lambda: self._save(namespace, toks, caches, captured, handed))

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

    def _save(
        self,
        namespace: str,
        tokens: list[int],
        caches: list[Any],
        captured: dict[tuple[int, int], Any],
        handed: float,
    ) -> None:
        t0 = time.perf_counter()
        try:
            result = self.store.save(namespace, tokens, caches, captured=captured)
        except STORE_FAULTS as exc:
            unavailable = isinstance(exc, StoreUnavailableError)
            reason = MissReason.UNAVAILABLE if unavailable else STORE_ERROR
            log.warning("kvstore: a save failed (%s; generation unaffected): %s", reason, exc)
            with self._lock:
                self._counters.save_errors[reason] += 1
            self._emit(
                SaveEvent(
                    namespace,
                    len(tokens),
                    seconds=time.perf_counter() - t0,
                    waited_s=t0 - handed,
                    error=f"{type(exc).__name__}: {exc}",
                    reason=reason,
                )
            )
            return
        event = SaveEvent(
            namespace,
            len(tokens),
            len(result.written),
            result.written_bytes,
            result.deduplicated,
            time.perf_counter() - t0,
            t0 - handed,
        )
        with self._lock:
            c = self._counters
            c.saves += 1
            c.saved_blocks += event.written_blocks
            c.saved_bytes += event.written_bytes
            c.deduplicated_blocks += event.deduplicated
        self._emit(event)

    def _emit(self, event: FetchEvent | SaveEvent) -> None:
        for listener in self._listeners:
            try:
                listener(event)
            except Exception:  # a metrics bug must not fail a request
                log.exception("kvstore: a prompt-cache listener failed")


def _as_token_list(tokens: Any, operation: str) -> list[int]:
    if isinstance(tokens, mx.array):
        tokens = tokens.tolist()
    toks = [int(t) for t in np.asarray(tokens, dtype=np.int64).reshape(-1)]
    if not toks:
        raise ValueError(f"[{operation}] The prompt is empty; pass at least one token id.")
    return toks


def _held(caches: Sequence[Any]) -> int | None:
    """Tokens the caches hold KV for (the least over layers with an offset)."""
    offsets = [int(c.offset) for c in caches if isinstance(getattr(c, "offset", None), int)]
    return min(offsets) if offsets else None


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
