"""One demo session, in a process of its own: ``python -m kvstore.demo.session SPEC OUT``.

A session is what an inference process does with a prefix store: load the
model, answer one prompt with ``generate(..., store=)`` (restore the longest
stored prefix, prefill the rest, generate, save), and exit. It reads its
:class:`SessionSpec` from the JSON file SPEC and writes a
:class:`SessionResult` to OUT; progress bars go to stderr.

Besides the store's own figures, a session writes the mlx-lm prompt-cache
file the same session would keep without a store (the caches after
generation, through the installed ``mlx_lm.models.cache.save_prompt_cache``,
or kvstore's exporter in the installed mlx-lm's layout) and reports its size.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["SessionSpec", "SessionResult", "run_session", "main", "load_model_for"]

#: Prompt tokens of the untimed run that warms up a fresh process.
WARMUP_TOKENS = 8


@dataclass(frozen=True)
class SessionSpec:
    """What one session does.

    Attributes:
        label: the session's name in the demo ("1", "baseline").
        model: ``{"config": name, "seed": n}`` (seeded weights) or ``{"dir": path}``
            (with ``"dequantize": True``: quantized weights made dense in float32).
        prompt: token ids.
        max_tokens: answer length at most.
        stop_tokens: token ids that end the answer.
        presence_penalty: greedy decoding with mlx-lm's presence penalty over the
            newest ``penalty_context`` tokens of the prompt and answer (0: plain greedy).
        penalty_context: the penalty's window.
        store: the store URL; ``None`` runs without a store (the baseline).
        namespace: the model's namespace in the store.
        mlx_lm_file: where to write the session's mlx-lm prompt-cache file (``None``: not).
        progress: show progress bars on stderr.
    """

    label: str
    model: dict[str, Any]
    prompt: list[int]
    max_tokens: int
    stop_tokens: list[int] = field(default_factory=list)
    presence_penalty: float = 0.0
    penalty_context: int = 20
    store: str | None = None
    namespace: str | None = None
    mlx_lm_file: str | None = None
    progress: bool = True


@dataclass(frozen=True)
class SessionResult:
    """What one session measured (times in seconds, sizes in bytes).

    ``lookups``/``hits``/``misses`` are the session's store handle's activity
    counters; ``saved_*`` what its save added to the store.
    """

    label: str
    pid: int
    blas: str
    prompt_tokens: int
    reused_tokens: int
    ttft_s: float
    lookup_s: float
    restore_s: float
    decode_tps: float
    save_s: float
    answer: list[int]
    lookups: int = 0
    hits: int = 0
    misses: dict[str, int] = field(default_factory=dict)
    saved_blocks: int = 0
    saved_bytes: int = 0
    deduplicated_blocks: int = 0
    mlx_lm_file_bytes: int | None = None
    mlx_lm_writer: str | None = None
    store_error: str | None = None

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> SessionResult:
        return cls(**obj)


def load_model_for(spec_model: dict[str, Any]) -> tuple[Any, Any]:
    """``(model, tokenizer or None)`` for a session's ``model`` entry; quantized weights
    are made dense when it says ``"dequantize": true`` (:mod:`kvstore.demo.dense`)."""
    from kvstore.model import build_model, load_model

    if "dir" in spec_model:
        model, tokenizer = load_model(spec_model["dir"])
        if spec_model.get("dequantize"):
            from kvstore.demo.dense import dequantize

            dequantize(model)
        return model, tokenizer
    return build_model(spec_model["config"], seed=int(spec_model.get("seed", 0))), None


def _sampler(spec: SessionSpec) -> Any:
    """Greedy, penalised as ``spec`` says; from the whole prompt, so a session that
    restores part of it from the store decodes as one that computed all of it."""
    from kvstore.model.sampling import PenalisedSampler, greedy

    if not spec.presence_penalty:
        return greedy
    return PenalisedSampler(
        spec.prompt,
        greedy,
        presence_penalty=spec.presence_penalty,
        presence_context_size=spec.penalty_context,
    )


def _bar(show: bool, **kwargs: Any) -> Any:
    from tqdm import tqdm

    # disable=None: no bar when stderr is not a terminal (logs, tests).
    return tqdm(file=sys.stderr, disable=None if show else True, leave=False, **kwargs)


def _write_mlx_lm_file(path: str, caches: list[Any]) -> tuple[int, str]:
    """Write ``caches`` as an mlx-lm prompt-cache file; ``(bytes, which writer)``: mlx-lm's
    own writer where a tested mlx-lm is installed, else ours, in the layout the installed
    mlx-lm loads (mlx-lm is an optional extra, and the releases Python 3.10 gets, 0.31 and
    older, write only caches of their own classes)."""
    try:
        from mlx_lm.models.cache import save_prompt_cache

        from kvstore.mlx_lm.version import mlx_lm_is_tested, mlx_lm_version
    except ImportError:
        untested = "not installed"
    else:
        if mlx_lm_is_tested():
            save_prompt_cache(path, caches)
            return os.path.getsize(path), "mlx_lm save_prompt_cache"
        untested = f"{mlx_lm_version()} untested"
    from kvstore.codecs.prompt_cache import export_prompt_cache, installed_file_layout

    export_prompt_cache(path, caches, layout=installed_file_layout())
    return os.path.getsize(path), f"kvstore export_prompt_cache (mlx-lm {untested})"


def run_session(spec: SessionSpec) -> SessionResult:
    """Run one session in this process (see the module docstring)."""
    from kvstore.bench.machine import blas_info
    from kvstore.bridge import generate_tokens
    from kvstore.store import open_store

    model, _ = load_model_for(spec.model)
    # A fresh process's first model call pays one-time set-up (thread pools,
    # BLAS init): keep it out of the measured TTFT, with or without a store.
    generate_tokens(model, list(range(WARMUP_TOKENS)), max_tokens=2)
    caches = model.make_cache()
    store = None if spec.store is None else open_store(spec.store)
    n = len(spec.prompt)
    bar = _bar(spec.progress, total=n, desc=f"session {spec.label} prefill", unit="tok")

    def on_chunk(end: int, _caches: list[Any]) -> None:
        bar.update(end - bar.n)  # the first chunk starts after the restored prefix
        if end == n:
            bar.close()

    kwargs: dict[str, Any] = dict(
        caches=caches,
        max_tokens=spec.max_tokens,
        stop_tokens=spec.stop_tokens,
        sampler=_sampler(spec),
        on_prefill_chunk=on_chunk,
    )
    try:
        if store is None:
            answer, stats = generate_tokens(model, spec.prompt, **kwargs)
        else:
            answer, stats = generate_tokens(
                model, spec.prompt, store=store, namespace=spec.namespace, **kwargs
            )
            # The save was handed to the store's writer thread: its blocks and bytes are
            # counted once it commits.
            store.flush()
        activity = store.activity() if store is not None else {}
    finally:
        bar.close()
        if store is not None:
            store.close()
    file_bytes = writer = None
    if spec.mlx_lm_file is not None:
        file_bytes, writer = _write_mlx_lm_file(spec.mlx_lm_file, caches)
    return SessionResult(
        label=spec.label,
        pid=os.getpid(),
        blas=blas_info()["mlx"],
        prompt_tokens=n,
        reused_tokens=stats.reused_tokens,
        ttft_s=stats.ttft_s,
        lookup_s=stats.lookup_s,
        restore_s=stats.restore_s,
        decode_tps=stats.decode_tps,
        save_s=stats.save_s,
        answer=[int(t) for t in answer],
        lookups=int(activity.get("lookups", 0)),
        hits=int(activity.get("hits", 0)),
        misses={str(k): int(v) for k, v in dict(activity.get("misses", {})).items()},
        saved_blocks=int(activity.get("saved_blocks", 0)),
        saved_bytes=int(activity.get("saved_bytes", 0)),
        deduplicated_blocks=int(activity.get("deduplicated_blocks", 0)),
        mlx_lm_file_bytes=file_bytes,
        mlx_lm_writer=writer,
        store_error=stats.store_error,
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2:
        print("usage: python -m kvstore.demo.session SPEC.json RESULT.json", file=sys.stderr)
        return 2
    spec = SessionSpec(**json.loads(Path(args[0]).read_text()))
    result = run_session(spec)
    Path(args[1]).write_text(json.dumps(dataclasses.asdict(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
