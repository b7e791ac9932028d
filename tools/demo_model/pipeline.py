"""One run of the tool, end to end: corpus, tokenizer, training, samples, export, check.

Every line it reports goes to stdout as it happens and into the export's
``train_log.txt``; the export's ``README.md`` is written from the run's own
figures.
"""

from __future__ import annotations

import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx

from kvstore.demo.script import Turn, question_text

from . import bpe
from .corpus import read_corpus
from .export import export
from .model import Llama, init_weights, quantized_bytes
from .recipes import Recipe
from .train import greedy_sample, train
from .verify import MAX_BYTES, check

__all__ = ["run", "SAMPLE_PROMPTS"]

#: What the log shows the model writing after training (greedy, 64 tokens each).
SAMPLE_PROMPTS = (
    "# ---- demo/parse.py ----\nimport json\n\n\ndef ",
    question_text(Turn("How do I wrap a long paragraph to 60 columns?")),
)


def run(
    recipe: Recipe,
    name: str,
    out: Path,
    *,
    tokenizer_file: Path | None = None,
    corpus_root: Path | None = None,
    verify: bool = True,
    say: Callable[[str], None] = print,
) -> Path:
    """Train ``recipe`` and write its export to ``out``; returns ``out``.

    Args:
        recipe: what to train.
        name: the recipe's name (for the README's retrain command).
        out: the export directory (created).
        tokenizer_file: a ``tokenizer.json`` to reuse instead of training one.
        corpus_root: the standard library to train on (this Python's by default; the
            GPU machine's Python 3.12 lacks ``test/``, so the run carries 3.11's).
        verify: run :func:`.verify.check` on the export (a failure is reported, not raised:
            the weights are written by then).
        say: gets every line of the log.

    Raises:
        ValueError: a shape whose 4-bit export would not fit the 8 MB budget.
    """
    lines: list[str] = []

    def log(line: str) -> None:
        lines.append(line)
        say(line)

    shape, cfg = recipe.shape, recipe.train
    estimate = quantized_bytes(shape)
    if estimate > MAX_BYTES - 500_000:  # tokenizer.json and the rest take ~0.3 MB
        raise ValueError(
            f"[demo_model] The 4-bit export must fit {MAX_BYTES:,} bytes with its tokenizer; "
            f"this shape's weights alone take ~{estimate:,}. Shrink hidden, layers or MLP."
        )
    started = time.perf_counter()
    log(
        f"demo_model {name}: mlx {mx.__version__} on {mx.default_device()}, python "
        f"{platform.python_version()} ({sys.executable})"
    )
    corpus = read_corpus(corpus_root, max_bytes=recipe.max_corpus_bytes, seed=cfg.seed)
    log(corpus.describe())

    t = time.perf_counter()
    if tokenizer_file is not None:
        tokenizer = bpe.load_tokenizer(tokenizer_file)
        log(f"tokenizer {tokenizer_file} ({tokenizer.get_vocab_size()} ids)")
    else:
        tokenizer = bpe.train_tokenizer(corpus.train, shape.vocab_size)
        log(
            f"tokenizer byte-level BPE, {tokenizer.get_vocab_size()} ids, trained in "
            f"{time.perf_counter() - t:.1f} s"
        )
    if tokenizer.get_vocab_size() != shape.vocab_size:
        raise ValueError(
            f"[demo_model] The tokenizer must have the model's {shape.vocab_size} ids; "
            f"received {tokenizer.get_vocab_size()}. Train a new one (drop --tokenizer)."
        )
    t = time.perf_counter()
    train_ids = bpe.encode_documents(tokenizer, corpus.train)
    eval_ids = bpe.encode_documents(tokenizer, corpus.eval)
    sizes = bpe.token_bytes(tokenizer)
    train_bytes = sum(len(d.encode("utf-8")) for d in corpus.train)
    log(
        f"encoded {len(train_ids):,} + {len(eval_ids):,} tokens in "
        f"{time.perf_counter() - t:.1f} s ({train_bytes / len(train_ids):.2f} bytes/token)"
    )

    model = Llama(shape, dropout=cfg.dropout)
    init_weights(model, cfg.seed)
    log(
        f"model llama {shape.num_hidden_layers} layers, hidden {shape.hidden_size}, "
        f"{shape.num_attention_heads}/{shape.num_key_value_heads} heads of {shape.head_dim}, "
        f"MLP {shape.intermediate_size}, vocab {shape.vocab_size}: {shape.parameters():,} "
        f"parameters, ~{estimate / 1e6:.2f} MB at 4 bits"
    )
    result = train(model, train_ids, eval_ids, sizes, cfg, log=log)

    eot = tokenizer.token_to_id(bpe.EOT)
    samples = []
    try:
        for prompt in SAMPLE_PROMPTS:
            ids = greedy_sample(model, tokenizer.encode(prompt).ids, 64, stop=eot)
            samples.append((prompt, tokenizer.decode(ids)))
            log(f"sample {prompt!r} -> {samples[-1][1]!r}")
    except Exception as exc:  # samples are for the README: never lose the weights to one
        log(f"sample FAILED: {type(exc).__name__}: {exc}")

    training: dict[str, Any] = {
        "recipe": name,
        "steps": result.steps,
        "best_step": result.best_step,
        "tokens_seen": result.tokens_seen,
        "batch": [cfg.batch_size, cfg.seq_len],
        "train_seconds": round(result.seconds),
        "eval_loss": round(result.eval_loss, 4),
        "eval_bits_per_byte": round(result.eval_bits_per_byte, 4),
        "corpus": f"{corpus.python} standard library .py sources "
        f"({', '.join(p + '/' for p in corpus.held_out)} held out for eval)",
        "device": device_name(),
    }
    readme = _readme(name, shape.parameters(), shape.vocab_size, training, samples)
    log(f"export {out} ({time.perf_counter() - started:.0f} s since the start)")
    export(shape, result.params, tokenizer, out, training=training, readme=readme, log_lines=lines)
    if verify:
        try:
            for line in check(out):
                log(f"check {line}")
        except Exception as exc:  # the weights are written; say what failed and go on
            log(f"check FAILED: {type(exc).__name__}: {exc}")
        (out / "train_log.txt").write_text("\n".join(lines) + "\n")
    return out


def device_name() -> str:
    """The device training ran on, in words."""
    device = mx.default_device()
    if device.type == mx.DeviceType.gpu:
        return "one GPU (MLX's CUDA backend)" if mx.cuda.is_available() else "the GPU (Metal)"
    return f"the CPU ({platform.machine()})"


def _readme(
    name: str,
    parameters: int,
    vocab: int,
    training: dict[str, Any],
    samples: list[tuple[str, str]],
) -> str:
    shown = "\n\n".join(f"```\n{prompt}{text}\n```" for prompt, text in samples)
    t = training
    placeholder = (
        ""
        if name == "h200"
        else "\n**A placeholder**: trained on a CPU for minutes, it writes little but "
        "whitespace. The shipped model is the `h200` recipe's (`gpu_train.sh`).\n"
    )
    return f"""# kvstore demo model

A small byte-level-BPE llama trained from scratch on Python's standard library,
shipped with kvstore so that `kvstore demo` (`make demo`) answers in text.
It writes plausible Python; it is not an assistant.
{placeholder}
- Layout: an mlx-lm `llama` directory, 4-bit affine weights (group 64, bfloat16
  scales), tied embeddings; {parameters:,} parameters. Loads with `mlx_lm.load`
  and `kvstore.model.load_model`.
- Tokenizer: byte-level BPE of {vocab} ids (`tokenizers`); any text round-trips.
  `<|endoftext|>` (id 0) starts every document and is BOS and EOS. The chat
  template writes the demo's questions (each a new `answers.py` whose docstring
  is the question).
- Corpus: {t["corpus"]}; one document per file, under a `# ---- path ----` line.
- Training (recipe `{name}`): {t["steps"]:,} steps of {t["batch"][0]} x {t["batch"][1]} tokens
  ({t["tokens_seen"]:,} tokens) in {t["train_seconds"]} s on {t["device"]}; AdamW, cosine
  schedule. The weights are step {t["best_step"]:,}'s, the best on the held-out text:
  {t["eval_loss"]:.3f} nats/token, {t["eval_bits_per_byte"]:.3f} bits/byte. `train_log.txt`
  is the run's log.

Retrain: `python -m tools.demo_model train --recipe {name} --out DIR` from the
repository root (`bash tools/demo_model/gpu_train.sh` on the GPU machine), then
copy DIR's files over `kvstore/demo/model/`.

Greedy samples after training:

{shown}
"""
