"""Named recipes: a model shape, a tokenizer size, a corpus size and a training config.

* ``h200`` -- the shipped model: one H200, about 4.5 minutes of training
  (``gpu_train.sh``; pycode-lm's 64 x 1024-token steps took 42 ms there);
* ``cpu`` -- the same model trained for 10 minutes on this 2-core machine: a
  placeholder with the real shape, file names and size, but barely trained;
* ``toy`` -- tiny dimensions and a few steps: tests and smoke runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from .model import PRESET_SHAPES, ModelShape
from .train import TrainConfig

__all__ = ["Recipe", "RECIPES"]


@dataclass(frozen=True)
class Recipe:
    """Everything a run needs besides the machine."""

    shape: ModelShape
    train: TrainConfig
    max_corpus_bytes: int | None = None
    #: Bytes of the corpus the tokenizer learns from (all of the training text when None).
    tokenizer_bytes: int | None = None


RECIPES: dict[str, Recipe] = {
    "h200": Recipe(
        PRESET_SHAPES["demo"],
        TrainConfig(
            batch_size=32,
            seq_len=2048,
            learning_rate=2e-3,
            warmup_steps=200,
            time_budget_s=270,
            # pycode-lm (16 epochs, no dropout) ended at 0.31 nats/byte on its training
            # text and 0.85 on held-out text: fewer passes, and dropout.
            max_epochs=10,
            dropout=0.1,
            eval_every=250,
            eval_windows=64,
        ),
    ),
    "cpu": Recipe(
        PRESET_SHAPES["demo"],
        TrainConfig(
            batch_size=4,
            seq_len=512,
            learning_rate=3e-3,
            warmup_steps=20,
            time_budget_s=600,
            eval_every=40,
            eval_windows=8,
        ),
        max_corpus_bytes=4_000_000,
    ),
    "toy": Recipe(
        PRESET_SHAPES["toy"],
        TrainConfig(
            batch_size=4,
            seq_len=64,
            learning_rate=3e-3,
            warmup_steps=4,
            max_steps=24,
            time_budget_s=120,
            eval_every=8,
            eval_windows=4,
        ),
        max_corpus_bytes=300_000,
    ),
}
