"""The training loop: AdamW, linear warm-up then cosine decay, sized to a wall-clock budget.

The run is planned in steps but bounded in seconds: after a few steps (the
first ones compile) the measured step time fixes how many steps fit the
budget, and the cosine schedule is laid over that many. Held-out loss is
measured every ``eval_every`` steps and the parameters at the best one are
what the run returns: on a 9 M-token corpus a 12 M-parameter model starts to
memorise within the budget (pycode-lm ended at 0.31 nats/byte on its training
text, 0.85 on held-out text), which ``max_epochs`` and residual ``dropout``
also hold back.
Parameters and optimizer state are float32 (MLX's CUDA matmuls run float32
as TF32 unless ``MLX_ENABLE_TF32=0``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from .model import Llama

__all__ = ["TrainConfig", "TrainResult", "train", "evaluate", "greedy_sample"]

#: Steps timed (after the compiling ones) before the run is planned.
CALIBRATION_STEPS = 20
COMPILE_STEPS = 5


@dataclass(frozen=True)
class TrainConfig:
    """How to train (see the module docstring)."""

    batch_size: int
    seq_len: int
    learning_rate: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 200
    max_steps: int = 100_000
    #: Passes over the training stream at most (the budget may allow more than pay off).
    max_epochs: float = 1e9
    time_budget_s: float = 270.0
    eval_every: int = 250
    eval_windows: int = 64
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    #: Residual dropout while training (the model built with it; evaluation turns it off).
    dropout: float = 0.0
    seed: int = 0


@dataclass
class TrainResult:
    """What a run did; ``params`` are the best held-out checkpoint's (flat name -> array)."""

    params: dict[str, mx.array]
    steps: int
    tokens_seen: int
    seconds: float
    best_step: int
    eval_loss: float
    eval_bits_per_byte: float
    train_loss: float
    history: list[dict[str, float]] = field(default_factory=list)


def learning_rate(step: int, total: int, cfg: TrainConfig) -> float:
    """Linear warm-up to the peak, then cosine down to ``min_lr_ratio`` of it at ``total``."""
    if step < cfg.warmup_steps:
        return cfg.learning_rate * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps))
    floor = cfg.learning_rate * cfg.min_lr_ratio
    return floor + (cfg.learning_rate - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def evaluate(
    model: Llama, tokens: np.ndarray, sizes: np.ndarray, cfg: TrainConfig
) -> tuple[float, float]:
    """``(nats per token, bits per byte)`` over the first ``eval_windows`` whole windows
    of the held-out stream (each window scores its ``seq_len`` next tokens)."""
    n = min(cfg.eval_windows, (len(tokens) - 1) // cfg.seq_len)
    if n < 1:
        raise ValueError(
            f"[demo_model] The held-out text must fill one {cfg.seq_len}-token window; "
            f"received {len(tokens)} tokens. Hold out more packages or shorten seq_len."
        )
    windows = np.stack(
        [tokens[i * cfg.seq_len : (i + 1) * cfg.seq_len + 1] for i in range(n)]
    ).astype(np.int32)
    training = model.training
    model.eval()
    nats = 0.0
    for start in range(0, n, cfg.batch_size):
        batch = mx.array(windows[start : start + cfg.batch_size])
        losses = nn.losses.cross_entropy(model(batch[:, :-1]), batch[:, 1:], reduction="sum")
        nats += losses.item()
    model.train(training)
    scored = n * cfg.seq_len
    text_bytes = int(sizes[windows[:, 1:]].sum())
    return nats / scored, nats / math.log(2) / max(1, text_bytes)


def greedy_sample(model: Llama, prompt: list[int], n: int, stop: int | None = None) -> list[int]:
    """``n`` greedy tokens after ``prompt`` (whole-sequence re-runs: short samples only)."""
    ids = list(prompt)
    for _ in range(n):
        logits = model(mx.array([ids]))[0, -1]
        token = int(mx.argmax(logits).item())
        if token == stop:
            break
        ids.append(token)
    return ids[len(prompt) :]


def train(
    model: Llama,
    train_tokens: np.ndarray,
    eval_tokens: np.ndarray,
    sizes: np.ndarray,
    cfg: TrainConfig,
    log: Callable[[str], None] = print,
) -> TrainResult:
    """Train ``model`` in place on random windows of ``train_tokens`` (see the module docstring).

    Args:
        model: the decoder, initialised.
        train_tokens, eval_tokens: id streams.
        sizes: bytes of text per id (for bits per byte).
        cfg: the recipe.
        log: gets one line per report.

    Raises:
        ValueError: a corpus shorter than one window.
    """
    span = cfg.seq_len + 1
    if len(train_tokens) <= span:
        raise ValueError(
            f"[demo_model] The training stream must be longer than one window ({span} "
            f"tokens); received {len(train_tokens)}. Use more of the corpus."
        )
    rng = np.random.default_rng(cfg.seed)
    optimizer = optim.AdamW(
        learning_rate=cfg.learning_rate, betas=[0.9, 0.95], weight_decay=cfg.weight_decay
    )

    def loss_fn(m: Llama, x: mx.array, y: mx.array) -> mx.array:
        return nn.losses.cross_entropy(m(x), y, reduction="mean")

    model.train()
    # The random state travels with the compiled step: dropout draws from it.
    state = [model.state, optimizer.state, mx.random.state]

    @partial(mx.compile, inputs=state, outputs=state)
    def step(x: mx.array, y: mx.array) -> mx.array:
        loss, grads = nn.value_and_grad(model, loss_fn)(model, x, y)
        grads, _ = optim.clip_grad_norm(grads, cfg.grad_clip)
        optimizer.update(model, grads)
        return loss

    def batch() -> mx.array:
        starts = rng.integers(0, len(train_tokens) - span, size=cfg.batch_size)
        return mx.array(np.stack([train_tokens[s : s + span] for s in starts]))

    per_step = cfg.batch_size * cfg.seq_len
    epoch_steps = max(1, int(cfg.max_epochs * len(train_tokens) / per_step))
    log(
        f"train {len(train_tokens)} tokens, eval {len(eval_tokens)} tokens; "
        f"{per_step} tokens a step ({cfg.batch_size} x {cfg.seq_len})"
    )
    started = time.perf_counter()
    planned = min(cfg.max_steps, epoch_steps)
    best: dict[str, Any] = {"loss": math.inf, "bpb": math.inf, "step": 0, "params": None}
    history: list[dict[str, float]] = []
    timed_from = (0.0, 0)
    losses: list[mx.array] = []
    last_loss = math.nan
    n = 0

    def checkpoint(at: int) -> None:
        loss, bpb = evaluate(model, eval_tokens, sizes, cfg)
        mean = float(np.mean([x.item() for x in losses])) if losses else math.nan
        losses.clear()
        history.append({"step": at, "train_loss": mean, "eval_loss": loss, "eval_bpb": bpb})
        mark = ""
        if loss < best["loss"]:
            # References, not copies: the optimizer makes new arrays, these stay as they are.
            best.update(loss=loss, bpb=bpb, step=at, params=dict(tree_flatten(model.parameters())))
            mark = " *"
        log(
            f"step {at}/{planned} t {time.perf_counter() - started:.0f}s "
            f"loss {mean:.4f} eval {loss:.4f} bpb {bpb:.3f} "
            f"lr {learning_rate(at, planned, cfg):.2e}{mark}"
        )

    while n < planned:
        optimizer.learning_rate = learning_rate(n, planned, cfg)
        data = batch()
        loss = step(data[:, :-1], data[:, 1:])
        mx.async_eval(state, loss)
        if losses:  # at most one step in flight: the next batch is built while it runs
            mx.eval(losses[-1])
        losses.append(loss)
        n += 1
        if n == COMPILE_STEPS:
            mx.eval(state)
            timed_from = (time.perf_counter(), n)
        elif n == COMPILE_STEPS + CALIBRATION_STEPS or (
            n > COMPILE_STEPS + CALIBRATION_STEPS and n % cfg.eval_every == 0 and n < planned // 2
        ):
            # Plan (and, during the first half, re-plan) the steps the budget holds; the
            # periodic evaluations are inside the measured time.
            mx.eval(state)
            now = time.perf_counter()
            per = (now - timed_from[0]) / (n - timed_from[1])
            fit = n + int((cfg.time_budget_s - (now - started)) / per)
            before, planned = planned, max(n + 1, min(cfg.max_steps, epoch_steps, fit))
            if n == COMPILE_STEPS + CALIBRATION_STEPS or abs(planned - before) > before // 20:
                log(
                    f"plan {per * 1e3:.1f} ms/step ({per_step / per:,.0f} tokens/s): "
                    f"{planned} steps, {planned * per_step / len(train_tokens):.1f} epochs"
                )
        if n % cfg.eval_every == 0 or n == planned:
            last_loss = float(losses[-1].item())
            checkpoint(n)
        if time.perf_counter() - started > 1.2 * cfg.time_budget_s:
            log(f"stopped at step {n}: past 1.2x the {cfg.time_budget_s:.0f} s budget")
            last_loss = float(losses[-1].item()) if losses else last_loss
            checkpoint(n)
            break
    seconds = time.perf_counter() - started
    if best["params"] is None:  # every evaluation was NaN: keep what there is, and say so
        log("no finite held-out loss: exporting the last step's parameters")
        best["params"] = dict(tree_flatten(model.parameters()))
    model.update(tree_unflatten(list(best["params"].items())))
    model.eval()
    log(
        f"final step {n} train_loss {last_loss:.4f} best step {best['step']} "
        f"eval_loss {best['loss']:.4f} eval_bits_per_byte {best['bpb']:.4f} "
        f"tokens_seen {n * per_step} seconds {seconds:.0f}"
    )
    return TrainResult(
        params=best["params"],
        steps=n,
        tokens_seen=n * per_step,
        seconds=seconds,
        best_step=best["step"],
        eval_loss=best["loss"],
        eval_bits_per_byte=best["bpb"],
        train_loss=last_loss,
        history=history,
    )
