"""``mlx_lm.server`` with the persistent prompt cache injected at its prompt-cache seam.

mlx-lm's ``main()`` parses its own options and calls the module's
``run(host, port, model_provider)``, which makes an ``LRUPromptCache`` and a
``ResponseGenerator`` and serves ``APIHandler`` over HTTP. :func:`serve` runs
that same ``main()`` with ``run`` replaced by :func:`_run`, which makes the
same three things, each mlx-lm's class with one change:

* :class:`StoreModelProvider` binds each model it loads to the prompt cache
  (its namespace, or why it stays in memory), and warms it up
  (:mod:`~kvstore.serve.warmup`: its kernels built before the first request);
* the prompt cache is a :class:`~kvstore.mlx_lm.StorePromptCache`, saving
  through the store's own writer thread (``store.save_behind``: group commits
  under the store's ``durability``, never on the generation thread);
* :class:`StoreResponseGenerator` times the first token of each request;
* :class:`StoreAPIHandler` adds ``GET /metrics`` (Prometheus text) and
  ``GET /v1/kvstore/stats`` (JSON).

Everything else is mlx-lm's: the HTTP API, chat templates, tool and reasoning
parsers, continuous batching, SSE streaming, and every option of
``mlx_lm.server``. ``usage.prompt_tokens_details.cached_tokens`` counts what
the store restored too, so it is right after a restart.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm.server as mlx_server

from kvstore.abc.store import PrefixStore
from kvstore.bridge.fingerprint import cache_directory_digests
from kvstore.errors import CapabilityError, KVStoreError
from kvstore.mlx_lm import StorePromptCache, check_mlx_lm_version
from kvstore.mlx_lm.attention import unfused_for_model
from kvstore.model.attention import UNFUSED_ATTENTION
from kvstore.serve import warmup
from kvstore.serve.metrics import CONTENT_TYPE, ServeMetrics

__all__ = [
    "serve",
    "ServeState",
    "StoreModelProvider",
    "StoreResponseGenerator",
    "StoreAPIHandler",
]

log = logging.getLogger("kvstore.serve")


class ServeState:
    """What the server's parts share: the store, the prompt cache, the metrics."""

    def __init__(self, store: PrefixStore, prompt_cache: StorePromptCache):
        self.store = store
        self.prompt_cache = prompt_cache
        self.metrics = ServeMetrics(prompt_cache)
        prompt_cache.add_listener(self.metrics.observe)
        self.started = time.time()
        #: Each model path loaded and warmed up (a draft model's with " (draft)"): how
        #: long its warm-up took (None: failed).
        self.warmups: dict[str, float | None] = {}
        #: Each model path loaded: seconds mlx-lm's load took (``weights``: reading and
        #: evaluating them, the draft's too) and binding it to the store (``bind``: its
        #: fingerprint, from cached digests after a first start). A first request waits
        #: for both, and the warm-up, when it comes before they are done.
        self.loads: dict[str, dict[str, float]] = {}
        #: The mlx-lm modules whose few-query attention goes by plain ops where
        #: ``KVSTORE_UNFUSED_ATTENTION`` says so (:mod:`kvstore.mlx_lm.attention`).
        self.unfused_attention: set[str] = set()

    def stats(self) -> dict[str, Any]:
        """The ``/v1/kvstore/stats`` document."""
        from kvstore.mlx_lm import mlx_lm_version

        out = self.prompt_cache.stats()
        try:
            content = self.store.stats()
            out["store"].update(blocks=content.blocks, bytes=content.bytes, up=True)
        except KVStoreError as exc:
            out["store"].update(up=False, error=f"{type(exc).__name__}: {exc}")
        out["server"] = {
            "mlx_lm": mlx_lm_version(),
            "uptime_s": time.time() - self.started,
            "load_s": {path: dict(took) for path, took in self.loads.items()},
            "warmup_s": dict(self.warmups),
            "unfused_attention": {
                "modules": sorted(self.unfused_attention),
                "mode": os.environ.get(UNFUSED_ATTENTION, "auto"),
            },
        }
        return out


class StoreModelProvider(mlx_server.ModelProvider):  # type: ignore[misc]  # mlx-lm is untyped
    """mlx-lm's model provider, binding each model it loads to the prompt cache and
    warming it up (unless ``warm`` is off)."""

    def __init__(
        self, cli_args: Any, state: ServeState, warm: bool = True, warm_decode: int = 0
    ) -> None:
        super().__init__(cli_args)
        self.prompt_cache = state.prompt_cache
        self._state = state
        self._warm = warm
        self._warm_decode = warm_decode

    def _load(
        self, model_path: str, adapter_path: str | None = None, draft_model_path: str | None = None
    ) -> None:
        start = time.perf_counter()
        source = model_path if Path(model_path).is_dir() else None
        # The binding's fingerprint reads the files' digests first: hashed while mlx-lm
        # reads the same files (a new model's first start: 4.2 s for one 14 GiB file).
        hashing = None
        if source is not None:
            hashing = threading.Thread(
                target=cache_directory_digests, args=(source,), name="kvstore-digests", daemon=True
            )
            hashing.start()
        super()._load(model_path, adapter_path, draft_model_path)
        loaded = time.perf_counter()
        for model in (self.model, self.draft_model):
            if model is not None:  # before the warm-up, which then builds what they run
                self._state.unfused_attention.update(unfused_for_model(model))
        if hashing is not None:
            hashing.join()
        try:
            self.prompt_cache.bind(
                self.model_key,
                self.model,
                source=source,
                adapter_path=adapter_path if source is not None else None,
                draft_model=self.draft_model,
            )
        except KVStoreError as exc:  # unnamed: it stays in memory, like mlx-lm's own cache
            log.warning("kvstore: %s is served from memory only: %s", model_path, exc)
        phases = {"weights": loaded - start, "bind": time.perf_counter() - loaded}
        self._state.loads[model_path] = phases
        log.info(
            "kvstore: %s loaded in %.2f s, bound to the store in %.2f s",
            model_path,
            phases["weights"],
            phases["bind"],
        )
        if not self._warm:
            return
        cli = self.cli_args
        warmed = [(model_path, self.model)]
        if self.draft_model is not None:  # speculative decoding runs it on every request
            warmed.append((f"{draft_model_path} (draft)", self.draft_model))
        for name, model in warmed:  # on the thread that loads them: mlx-lm's generation thread
            took = warmup.warm_up(
                model,
                kv_bits=cli.kv_bits,
                kv_group_size=cli.kv_group_size,
                decode_up_to=self._warm_decode,
                # mlx-lm serves a batchable model through its BatchGenerator (not a draft)
                batched=model is self.model and bool(self.is_batchable) and cli.kv_bits is None,
            )
            self._state.warmups[name] = took
            if took is not None:
                log.info("kvstore: %s warmed up in %.2f s", name, took)


class StoreResponseGenerator(mlx_server.ResponseGenerator):  # type: ignore[misc]
    """mlx-lm's response generator, timing each request's first token, and batching
    requests under ``--kv-bits`` when every layer is one of our affine families."""

    def __init__(self, model_provider: StoreModelProvider, state: ServeState) -> None:
        self.kvstore = state  # before super().__init__: it starts the generation thread
        super().__init__(model_provider, state.prompt_cache)

    def _is_batchable(self, args: Any) -> bool:
        if self.cli_args.kv_bits is None:
            return bool(super()._is_batchable(args))
        # mlx-lm serves --kv-bits one at a time: its QuantizedKVCache cannot batch. Ours
        # can; the prompt cache hands them out when quantizing from the first token.
        binding = self.kvstore.prompt_cache.binding(self.model_provider.model_key)
        return bool(
            self.model_provider.is_batchable
            and args.seed is None
            and binding is not None
            and binding.quantizes_from_start
        )

    def generate(
        self,
        request: Any,
        generation_args: Any,
        progress_callback: Callable[[int, int], None] | None = None,
    ) -> tuple[Any, Iterator[Any]]:
        start = time.perf_counter()
        ctx, responses = super().generate(request, generation_args, progress_callback)
        return ctx, self._timed(responses, start)

    def _timed(self, responses: Iterator[Any], start: float) -> Iterator[Any]:
        first = True
        for response in responses:
            if first:
                self.kvstore.metrics.ttft.observe(time.perf_counter() - start)
                first = False
            yield response


class StoreAPIHandler(mlx_server.APIHandler):  # type: ignore[misc]
    """mlx-lm's request handler plus ``GET /metrics`` and ``GET /v1/kvstore/stats``."""

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        state: ServeState = getattr(self.response_generator, "kvstore")  # noqa: B009
        if path == "/metrics":
            body = state.metrics.exposition()
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE)
        elif path == "/v1/kvstore/stats":
            body = json.dumps(state.stats()).encode()
            self._set_completion_headers(200)
        else:
            super().do_GET()
            return
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        self.wfile.flush()


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def serve(
    mlx_lm_argv: Sequence[str],
    store: PrefixStore,
    *,
    tenant: str | None = None,
    save_queue: int = 32,
    warm_up: bool = True,
    warm_decode: int = 0,
    prog: str = "kvstore serve",
) -> int:
    """Run ``mlx_lm.server`` with ``mlx_lm_argv`` (its options) and ``store`` behind
    its prompt cache, until interrupted (SIGINT or SIGTERM); then close the store,
    which commits the saves still handed off. ``warm_up``: run each model once as it
    loads (:mod:`~kvstore.serve.warmup`); ``warm_decode``: with it, on a CUDA GPU, also
    build the decode graphs of conversations up to that many tokens.

    Raises:
        CapabilityError: mlx-lm outside the tested range, or a distributed run.
    """
    check_mlx_lm_version("kvstore serve")
    states: list[ServeState] = []

    def run(host: str, port: int, model_provider: Any) -> None:
        if mx.distributed.init().size() > 1:
            raise CapabilityError(
                "[kvstore serve] Distributed serving (mlx.launch) is not supported yet; "
                "run mlx_lm.server for that.",
                found="distributed",
            )
        cli = model_provider.cli_args
        prompt_cache = StorePromptCache(
            store,
            kv_bits=cli.kv_bits,
            kv_group_size=cli.kv_group_size,
            quantized_kv_start=cli.quantized_kv_start,
            tenant=tenant,
            max_size=cli.prompt_cache_size,
            max_pending=save_queue,
        )
        state = ServeState(store, prompt_cache)
        states.append(state)
        provider = StoreModelProvider(cli, state, warm=warm_up, warm_decode=warm_decode)
        generator = StoreResponseGenerator(provider, state)
        log.info("kvstore: prompt cache persisted in %s", store.url)
        mlx_server._run_http_server(host, port, generator, handler_class=StoreAPIHandler)

    saved = sys.argv, mlx_server.run
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    sys.argv = [prog, *mlx_lm_argv]
    mlx_server.run = run  # type: ignore[assignment]  # the seam: mlx-lm's main() calls it
    try:
        mlx_server.main()
    finally:
        sys.argv, mlx_server.run = saved
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        store.close()  # commits what was handed off first
    return 0
