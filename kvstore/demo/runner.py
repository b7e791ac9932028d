"""The demo's conductor: plan the sessions, run each in a fresh process, gather what they measured.

:func:`run_demo` works in this order:

1. choose the BLAS for the session processes (:mod:`kvstore.demo.blas`) and
   size the shared context to it (4096 tokens with a fast BLAS, 1024 on MLX's
   bundled one, unless ``context_tokens`` says otherwise; never past the
   model's positions: the shipped model has 2048);
2. name the model's namespace and look at the store: a store already holding
   blocks of this model means the run starts warm (and says so);
3. measure the time to first token of the shortest prompt without a store,
   once, in a process of its own (the baseline every speed-up is against);
4. run the sessions of :data:`~kvstore.demo.script.TURNS` one after another,
   each a fresh process with the store: new questions over the shared
   context, and a follow-up turn extending an earlier conversation;
5. read the store's size and sum the mlx-lm prompt-cache files the sessions
   wrote (one each, in a temporary directory removed afterwards).

The model is the shipped one (:mod:`kvstore.demo.shipped`), an mlx-lm
directory, or seeded weights of a named config. It runs only in the session
processes; this process reads a directory lazily (or builds the seeded model)
once, to check it and name its namespace.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import kvstore
from kvstore.cli.options import DEFAULT_STORE
from kvstore.demo.blas import BlasChoice, choose_blas
from kvstore.demo.script import (
    PENALTY_CONTEXT,
    PRESENCE_PENALTY,
    TURNS,
    TextCodec,
    Turn,
    document_text,
    question_tokens,
)
from kvstore.demo.session import SessionResult, SessionSpec
from kvstore.demo.shipped import shipped_model_dir
from kvstore.errors import ModelLoadError, StoreConfigError

__all__ = [
    "DEFAULT_STORE",
    "CONTEXT_TOKENS",
    "DemoOptions",
    "DemoModel",
    "SessionRow",
    "DemoReport",
    "SessionFailed",
    "run_demo",
    "prepare_model",
    "plan_context",
]

#: Shared-context tokens by BLAS speed: a few seconds of prefill either way.
CONTEXT_TOKENS = {"fast": 4096, "slow": 1024}


class SessionFailed(RuntimeError):
    """A session process exited with an error (its traceback went to stderr)."""


@dataclass(frozen=True)
class DemoOptions:
    """What ``kvstore demo`` was asked for (see :mod:`kvstore.cli.demo`)."""

    store: str = DEFAULT_STORE
    #: An mlx-lm directory; with neither this nor ``config``, the shipped model.
    model_dir: str | None = None
    #: A named config of seeded weights (``small``, ``tiny``) instead of a directory.
    config: str | None = None
    seed: int = 0
    context_tokens: int | None = None
    answer_tokens: int = 48
    #: Greedy answers with mlx-lm's presence penalty over the newest PENALTY_CONTEXT tokens
    #: (0: plain greedy); see :mod:`kvstore.demo.script`.
    presence_penalty: float = PRESENCE_PENALTY
    blas: Literal["auto", "bundled"] = "auto"
    progress: bool = True


@dataclass(frozen=True)
class DemoModel:
    """The model as this process knows it: enough to plan and name, not to run."""

    spec: dict[str, Any]
    description: str
    namespace: str
    codec: TextCodec = field(repr=False)
    max_positions: int | None


@dataclass(frozen=True)
class SessionRow:
    """One session of the report: its turn, what it measured, its answer as text."""

    index: int
    question: str
    follows: int | None
    result: SessionResult
    answer_text: str | None


@dataclass(frozen=True)
class DemoReport:
    """Everything the demo prints (``kvstore demo --json`` prints this)."""

    store: str
    namespace: str
    model: str
    text: str
    decoding: str
    blas_choice: str
    blas_fast: bool
    context_tokens: int
    context_note: str | None
    warm: bool
    blocks_before: int
    bytes_before: int
    blocks_after: int
    bytes_after: int
    baseline: SessionResult
    baseline_of: int
    sessions: list[SessionRow]
    mlx_lm_files_bytes: int
    mlx_lm_writer: str
    seconds: float

    @property
    def blas_ran(self) -> list[str]:
        """The BLAS each session process reported mapping, deduplicated."""
        return sorted({self.baseline.blas, *(row.result.blas for row in self.sessions)})


def store_url(text: str) -> str:
    """The URL the sessions get: a relative LMDB path made absolute (they share a
    working directory, but the output should say where the store is).

    Raises:
        StoreConfigError: a scheme whose store does not outlive a process (``memory://``).
    """
    from kvstore.store.maintenance.inventory import lmdb_path, store_scheme

    scheme = store_scheme(text)
    if scheme == "memory":
        raise StoreConfigError(
            f"[demo] Each session is a process of its own, and a {text!r} store lives only "
            f"as long as its process. Give an LMDB directory or a Redis URL.",
            found=text,
        )
    path = lmdb_path(text)
    return f"lmdb://{os.path.abspath(path)}" if path is not None else text


def prepare_model(options: DemoOptions) -> DemoModel:
    """The model's session spec, description, namespace and text codec: the shipped
    model (:mod:`kvstore.demo.shipped`) unless a directory or a seeded config is asked for.

    Raises:
        ModelLoadError: both a directory and a config, an unknown config, a directory
            that is not a model, or tokenizer files no installed backend reads.
    """
    from kvstore.model import NAMED_CONFIGS, build_model
    from kvstore.store import namespace_for_model

    if options.model_dir is not None and options.config is not None:
        raise ModelLoadError(
            f"[demo] --model and --config are alternatives (a model directory, or seeded "
            f"weights); received both ({options.model_dir!r}, {options.config!r}). Drop one.",
            found=[options.model_dir, options.config],
        )
    if options.model_dir is not None:
        return _directory_model(Path(options.model_dir), shipped=False)
    if options.config is None:
        return _directory_model(shipped_model_dir(), shipped=True)
    if options.config not in NAMED_CONFIGS:
        raise ModelLoadError(
            f"[demo] Unknown --config {options.config!r}; known: {', '.join(NAMED_CONFIGS)}.",
            found=options.config,
            supported=list(NAMED_CONFIGS),
        )
    model = build_model(options.config, seed=options.seed)
    args = model.args
    return DemoModel(
        {"config": options.config, "seed": options.seed},
        f"'{options.config}' config with seeded weights ({args.num_hidden_layers} layers, "
        f"{args.vocab_size} token ids)",
        namespace_for_model(model),
        TextCodec(None, args.vocab_size, readable=False),
        args.max_position_embeddings,
    )


def _directory_model(path: Path, shipped: bool) -> DemoModel:
    """A :class:`DemoModel` of the mlx-lm directory ``path``."""
    import mlx.core as mx

    from kvstore.model import load_model
    from kvstore.model.tokenizer import TOKENIZER_BACKENDS
    from kvstore.store import namespace_for_model

    path = path.expanduser().resolve()
    # Lazy: the weights' names and shapes are checked here (a bad directory is
    # one line of error, not a failed session), their data is read by sessions.
    loaded, tokenizer = load_model(path, lazy=True)
    args = loaded.args
    if tokenizer is None and any(path.glob("tokenizer*")):
        raise ModelLoadError(
            f"[demo] {path} has tokenizer files but no tokenizer backend is installed "
            f"({' or '.join(TOKENIZER_BACKENDS)}); pip install 'mlx-kvstore[tokenizers]'.",
            path=str(path),
        )
    spec: dict[str, Any] = {"dir": str(path)}
    weights = ""
    quantization = loaded.config.get("quantization")
    if type(quantization) is dict:
        weights = f", {quantization.get('bits', '?')}-bit weights"
        # MLX's CPU quantized matmul is ~20x slower than BLAS (kvstore.demo.dense).
        if mx.default_device() == mx.cpu:
            spec["dequantize"] = True
            weights += ", run dense in float32 on the CPU"
    name = "the shipped demo model" if shipped else path.name
    return DemoModel(
        spec,
        f"{name} ({args.model_type}, {args.num_hidden_layers} layers, "
        f"{args.vocab_size} token ids{weights}) from {path}",
        namespace_for_model(path),
        TextCodec(tokenizer, args.vocab_size),
        args.max_position_embeddings,
    )


def plan_context(
    options: DemoOptions, blas: BlasChoice, model: DemoModel, reserve: int
) -> tuple[list[int], str | None]:
    """The shared context's tokens, and why it is not the default size, if it is not.

    ``reserve`` is the room the questions and answers need after the context
    (a model with a position limit gets a shorter context).
    """
    document = model.codec.encode(document_text(), first=True)
    note = None
    if options.context_tokens is not None:
        n = options.context_tokens
    elif blas.fast:
        n = CONTEXT_TOKENS["fast"]
    else:
        n = CONTEXT_TOKENS["slow"]
        note = (
            f"sized down from {CONTEXT_TOKENS['fast']}: MLX's bundled BLAS prefills ~10x "
            f"slower than OpenBLAS"
        )
    if model.max_positions and n + reserve > model.max_positions:
        n = model.max_positions - reserve
        note = f"capped so every prompt fits the model's {model.max_positions} positions"
    if n > len(document):
        n = len(document)
        note = f"the whole document: {n} tokens"
    return document[:n], note


def _stored(url: str, namespace: str) -> tuple[int, int] | None:
    """``(blocks, bytes)`` the store holds for ``namespace``; ``None`` when there is no store yet.

    Raises:
        StoreConfigError: something that is not a store is in the way.
    """
    from kvstore.store import open_store
    from kvstore.store.maintenance.inventory import lmdb_path, open_existing

    path = lmdb_path(url)
    if path is not None:
        if not os.path.exists(path) or (os.path.isdir(path) and not os.listdir(path)):
            return None
        opened = open_existing(url, operation="demo")
    else:  # a server: opening one creates nothing until the first save
        opened = open_store(url)
    with opened as store:
        ns = store.stats().namespaces.get(namespace)
    return (ns.blocks, ns.bytes) if ns is not None else (0, 0)


def _session_env(blas: BlasChoice) -> dict[str, str]:
    """The session processes' environment: the chosen BLAS, and this process's kvstore first."""
    env = dict(blas.env)
    root = str(Path(kvstore.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def _spawn(spec: SessionSpec, workdir: Path, env: dict[str, str]) -> SessionResult:
    """Run ``spec`` in a fresh ``python -m kvstore.demo.session`` process.

    Its stdout joins this process's stderr (so ``--json`` output stays clean);
    its progress bars and errors go to stderr as they happen.

    Raises:
        SessionFailed: the process exited with an error.
    """
    spec_file = workdir / f"session-{spec.label}.json"
    out_file = workdir / f"result-{spec.label}.json"
    spec_file.write_text(json.dumps(dataclasses.asdict(spec)))
    done = subprocess.run(
        [sys.executable, "-m", "kvstore.demo.session", str(spec_file), str(out_file)],
        env=env,
        stdout=2,
        check=False,
    )
    if done.returncode != 0:
        raise SessionFailed(
            f"demo session {spec.label} failed (exit status {done.returncode}); its error is "
            f"printed above."
        )
    return SessionResult.from_json(json.loads(out_file.read_text()))


def run_demo(options: DemoOptions, say: Callable[[str], None] = print) -> DemoReport:
    """Run the demo (module docstring); ``say`` gets a line as each step completes.

    Raises:
        StoreConfigError: a store URL the demo cannot use, or something that is
            not a store where the store should be.
        ModelLoadError: a model it cannot load.
        SessionFailed: a session process failed.
    """
    started = time.perf_counter()
    blas = choose_blas(options.blas)
    url = store_url(options.store)
    model = prepare_model(options)
    codec = model.codec
    questions = [question_tokens(codec, turn) for turn in TURNS]
    reserve = 2 * max(len(q) for q in questions) + 2 * options.answer_tokens
    context, note = plan_context(options, blas, model, reserve)
    before = _stored(url, model.namespace)
    warm = bool(before and before[0])

    how = decoding(options.presence_penalty)
    for line in _preamble(model, context, note, blas, url, before, how):
        say(line)
    env = _session_env(blas)
    prompts: list[list[int]] = []
    rows: list[SessionRow] = []
    with tempfile.TemporaryDirectory(prefix="kvstore-demo-") as tmp:
        workdir = Path(tmp)
        fresh = [i for i, turn in enumerate(TURNS) if turn.follows is None]
        baseline_of = min(fresh, key=lambda i: len(questions[i]))
        baseline = _spawn(
            SessionSpec(
                "baseline",
                model.spec,
                context + questions[baseline_of],
                1,
                presence_penalty=options.presence_penalty,
                penalty_context=PENALTY_CONTEXT,
                progress=options.progress,
            ),
            workdir,
            env,
        )
        say(
            f"baseline  session {baseline_of + 1}'s {baseline.prompt_tokens}-token prompt, no "
            f"store (pid {baseline.pid}): TTFT {seconds(baseline.ttft_s)}"
        )
        for i, turn in enumerate(TURNS):
            prompt = _prompt(turn, context, questions[i], prompts, rows)
            prompts.append(prompt)
            result = _spawn(
                SessionSpec(
                    str(i + 1),
                    model.spec,
                    prompt,
                    options.answer_tokens,
                    codec.stop_tokens,
                    store=url,
                    namespace=model.namespace,
                    mlx_lm_file=str(workdir / f"mlx-lm-session-{i + 1}.safetensors"),
                    presence_penalty=options.presence_penalty,
                    penalty_context=PENALTY_CONTEXT,
                    progress=options.progress,
                ),
                workdir,
                env,
            )
            row = SessionRow(i, turn.question, turn.follows, result, codec.decode(result.answer))
            rows.append(row)
            say(_session_line(row))
    after = _stored(url, model.namespace) or (0, 0)
    return DemoReport(
        store=url,
        namespace=model.namespace,
        model=model.description,
        text=codec.kind,
        decoding=how,
        blas_choice=blas.description,
        blas_fast=blas.fast,
        context_tokens=len(context),
        context_note=note,
        warm=warm,
        blocks_before=before[0] if before else 0,
        bytes_before=before[1] if before else 0,
        blocks_after=after[0],
        bytes_after=after[1],
        baseline=baseline,
        baseline_of=baseline_of,
        sessions=rows,
        mlx_lm_files_bytes=sum(r.result.mlx_lm_file_bytes or 0 for r in rows),
        mlx_lm_writer=rows[0].result.mlx_lm_writer or "-",
        seconds=time.perf_counter() - started,
    )


def decoding(presence_penalty: float) -> str:
    """How the sessions decode, in words."""
    if not presence_penalty:
        return "greedy"
    return f"greedy, presence penalty {presence_penalty:g} over the newest {PENALTY_CONTEXT} tokens"


def _preamble(
    model: DemoModel,
    context: list[int],
    note: str | None,
    blas: BlasChoice,
    url: str,
    before: tuple[int, int] | None,
    how: str,
) -> list[str]:
    """What the demo is about to do, and whether the store makes it a warm start."""
    if before is None:
        store = "new, created by the first save"
    elif before[0]:
        store = (
            f"WARM, it already holds {before[0]} blocks of this model (namespace "
            f"{model.namespace}) from an earlier run, so even session 1 reuses"
        )
    else:
        store = f"no blocks of this model yet (namespace {model.namespace})"
    return [
        f"kvstore demo: {len(TURNS)} sessions, each a fresh process, sharing one context",
        f"  model    {model.description}",
        f"  text     {model.codec.kind}",
        f"  decoding {how}",
        f"  context  {len(context)} tokens: a system prompt and standard-library sources",
        *([f"           ({note})"] if note else []),
        f"  BLAS     {blas.description}",
        f"  store    {url}: {store}",
        "",
    ]


def _prompt(
    turn: Turn,
    context: list[int],
    question: list[int],
    prompts: list[list[int]],
    rows: list[SessionRow],
) -> list[int]:
    """A new conversation: context + question; a follow-up: the earlier turn's
    prompt, its answer, then the question."""
    if turn.follows is None:
        return context + question
    return prompts[turn.follows] + rows[turn.follows].result.answer + question


def seconds(s: float) -> str:
    """``4.71 s`` or ``93 ms``."""
    return f"{s:.2f} s" if s >= 1 else f"{s * 1000:.0f} ms"


def _session_line(row: SessionRow) -> str:
    r = row.result
    how = "new conversation" if row.follows is None else f"follows session {row.follows + 1}"
    if row.answer_text is None:
        answer = f"{len(r.answer)} token ids (seeded weights write no text)"
    else:
        text = " ".join(row.answer_text.split())
        answer = repr(text if len(text) <= 60 else text[:57] + "...")
    error = f"; store error: {r.store_error}" if r.store_error else ""
    return (
        f"session {row.index + 1} ({how}, pid {r.pid}): {r.reused_tokens} of "
        f"{r.prompt_tokens} prompt tokens reused, TTFT {seconds(r.ttft_s)}; answer {answer}{error}"
    )
