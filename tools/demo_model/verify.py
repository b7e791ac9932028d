"""Check an export: its size, its tokenizer, and that mlx-lm and kvstore load it alike.

``check(dir)`` returns the lines of a report and raises
:class:`ExportCheckError` on the first failed check:

1. the directory holds every file of :data:`.export.FILES`, all together at most
   ``max_bytes`` (8 MB: what kvstore ships in its wheel);
2. the tokenizer round-trips text (non-ASCII and control characters included);
3. ``kvstore.model.load_model`` and ``mlx_lm.load`` both load it, and their logits
   over one prompt agree (same argmax everywhere, close values);
4. ``mlx_lm.generate`` writes text from a chat-template prompt.

A check whose package is not importable (``kvstore`` off the path, no
``mlx_lm``) is reported as skipped, so the GPU run's own check cannot lose
the weights it has written.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np

from .bpe import load_tokenizer
from .export import FILES

__all__ = ["ExportCheckError", "check", "MAX_BYTES", "ROUND_TRIP"]

#: What the shipped model may weigh, all files together (issue 15).
MAX_BYTES = 8_000_000

ROUND_TRIP = "def naïve(x):\n\treturn {'ü': x}  # ✓ \r\n\x00\x7f"
PROMPT = '# ---- json/__init__.py ----\n"""JSON (JavaScript Object Notation)'


class ExportCheckError(RuntimeError):
    """An export failed one of :func:`check`'s checks."""


def _fail(message: str) -> ExportCheckError:
    return ExportCheckError(f"[demo_model verify] {message}")


def check(path: Path, max_bytes: int = MAX_BYTES, generate_tokens: int = 40) -> list[str]:
    """Check the export at ``path`` (module docstring); the report's lines.

    Raises:
        ExportCheckError: a file is missing, the directory is too large, the tokenizer
            does not round-trip, or the two loaders disagree.
    """
    lines: list[str] = []
    missing = [f for f in FILES if not (path / f).is_file()]
    if missing:
        raise _fail(f"An export holds {', '.join(FILES)}; {path} lacks {', '.join(missing)}.")
    size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    if size > max_bytes:
        raise _fail(f"The export may weigh {max_bytes:,} bytes; {path} holds {size:,}.")
    files = len(list(path.iterdir()))
    lines.append(f"size      {size:,} bytes in {files} files (<= {max_bytes:,})")

    tokenizer = load_tokenizer(path / "tokenizer.json")
    ids = tokenizer.encode(ROUND_TRIP, add_special_tokens=False).ids
    back = tokenizer.decode(ids, skip_special_tokens=False)
    if back != ROUND_TRIP:
        raise _fail(f"The tokenizer must round-trip text; {ROUND_TRIP!r} came back {back!r}.")
    lines.append(f"tokenizer round-trips {len(ROUND_TRIP)} characters in {len(ids)} ids")

    prompt = tokenizer.encode(PROMPT).ids
    inputs = mx.array([prompt])
    ours = theirs = None
    try:
        from kvstore.model import load_model
    except ImportError as exc:
        lines.append(f"kvstore   skipped ({exc})")
    else:
        model, kv_tokenizer = load_model(path)
        if kv_tokenizer is None or kv_tokenizer.encode(PROMPT) != prompt:
            raise _fail("kvstore.model.load_model must load the tokenizer and encode alike.")
        ours = np.array(model(inputs).astype(mx.float32))
        lines.append(f"kvstore   load_model: {model.args.num_hidden_layers} layers, logits ok")
    try:
        from mlx_lm import generate, load
    except ImportError as exc:
        lines.append(f"mlx-lm    skipped ({exc})")
        return lines
    lm, wrapper = load(str(path))
    theirs = np.array(lm(inputs).astype(mx.float32))
    if ours is not None:
        agree = float((ours.argmax(-1) == theirs.argmax(-1)).mean())
        diff = float(np.abs(ours - theirs).max())
        if agree < 1.0 or diff > 0.05 * float(np.abs(theirs).max()):
            raise _fail(
                f"kvstore and mlx-lm must compute the same logits; the argmax agrees on "
                f"{agree:.0%} of positions and values differ by up to {diff:.3g}."
            )
        lines.append(f"logits    kvstore vs mlx-lm: same argmax, max |diff| {diff:.2e}")
    messages = [{"role": "user", "content": "How do I parse a JSON document held in a string?"}]
    chat = wrapper.apply_chat_template(messages, add_generation_prompt=True)
    text = generate(lm, wrapper, prompt=chat, max_tokens=generate_tokens, verbose=False)
    if not isinstance(text, str):
        raise _fail(f"mlx_lm.generate must return text; received {type(text).__name__}.")
    lines.append(f"generate  mlx_lm.generate on the chat template: {text!r}")
    return lines
