"""What the demo says: a shared context, the questions, how they become prompts,
and how answers are decoded.

The shared context is a system prompt followed by a document: the source of
a few standard-library modules (read from this Python's own installation,
so nothing needs shipping or downloading), cut to the context length. Each
session asks a question over it; one turn follows up an earlier one, so its
prompt is that session's prompt, its answer and a new question.

The shipped model is a code model (trained on the standard library's files,
each opening with ``<|endoftext|>`` and a ``# ---- path ----`` line), so a
question opens a file of its own whose docstring is the question, and the
model writes that file. Answers are greedy with mlx-lm's presence penalty
(:class:`kvstore.model.sampling.PenalisedSampler`): deterministic, so a warm
session writes what a cold one does.

Text becomes token ids through the model's tokenizer, or as UTF-8 bytes when
there is none (a byte-level model such as the pycode-lm fixture, or the
seeded ``small`` model, whose vocabulary includes the 256 byte values).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstore.errors import ModelLoadError

__all__ = [
    "SYSTEM_PROMPT",
    "DOCUMENT_MODULES",
    "Turn",
    "TURNS",
    "TextCodec",
    "document_text",
    "question_text",
    "question_tokens",
    "ANSWER_FILE",
    "PRESENCE_PENALTY",
    "PENALTY_CONTEXT",
]

SYSTEM_PROMPT = (
    "# You are a careful Python assistant. The module sources below are your\n"
    "# reference: answer each question with a short piece of code.\n\n"
)

#: Standard-library modules whose sources make the document, in order.
DOCUMENT_MODULES = (
    "json",
    "json.decoder",
    "json.encoder",
    "json.scanner",
    "textwrap",
    "string",
    "shlex",
    "fnmatch",
)


@dataclass(frozen=True)
class Turn:
    """One session's question; ``follows`` is the index of the session whose
    conversation it continues (``None``: a new conversation over the context)."""

    question: str
    follows: int | None = None


#: The sessions, in the order they run.
TURNS: tuple[Turn, ...] = (
    Turn("How do I parse a JSON document held in a string?"),
    Turn("How do I write a dict as JSON with sorted keys and an indent of 2?"),
    Turn("What does JSONDecodeError tell me when a document is malformed?"),
    Turn("And how do I catch it and print the line and column?", follows=2),
    Turn("How do I wrap a long paragraph to 60 columns?"),
)


#: The file each answer opens. Measured on the demo's shared context with the shipped
#: model (48 greedy tokens): ``# Question: ...`` / ``# Answer:`` comment lines led it into
#: comment loops (``#   -*-`` repeated), a new file with the question as its docstring into
#: classes and functions in the standard library's style.
ANSWER_FILE = "# ---- answers.py ----\n"

#: Subtracted from the log-probability of each token among the last PENALTY_CONTEXT
#: (mlx-lm's ``presence_penalty``/``presence_context_size``). Measured as above: plain
#: greedy repeats lines (``self.args = args`` over and over), 1.5-2.0 still does, 3.0 over
#: 128 tokens does not; over 64 the follow-up turn copied the answer it follows. The
#: question's ``<|endoftext|>`` is in the window too, so an answer does not end at once.
PRESENCE_PENALTY = 3.0
PENALTY_CONTEXT = 128


def question_text(turn: Turn) -> str:
    """The text of ``turn``'s question: a new file, the question its docstring."""
    return f'{ANSWER_FILE}"""{turn.question}"""\n\n'


def question_tokens(codec: TextCodec, turn: Turn) -> list[int]:
    """``turn``'s question as token ids: the tokenizer's BOS (the shipped model's
    ``<|endoftext|>``, which opens every file it was trained on), then its text."""
    return codec.encode(question_text(turn), first=True)


def document_text(modules: Sequence[str] = DOCUMENT_MODULES) -> str:
    """The system prompt and the sources of ``modules``, each under a header line.

    Raises:
        ModelLoadError: none of the sources can be read (a Python installed
            without its ``.py`` files).
    """
    parts = [SYSTEM_PROMPT]
    for name in modules:
        spec = importlib.util.find_spec(name)
        origin = Path(spec.origin) if spec and spec.origin else None
        if origin is None or origin.suffix != ".py" or not origin.is_file():
            continue
        relative = f"{name.replace('.', '/')}{'/__init__' if origin.stem == '__init__' else ''}.py"
        parts.append(f"# ---- {relative} ----\n{origin.read_text(encoding='utf-8')}\n")
    if len(parts) == 1:
        raise ModelLoadError(
            f"[demo] The demo's document is the source of {', '.join(modules)} from this "
            f"Python's standard library, and none of it is installed as .py files. Install "
            f"the full standard library (Debian: libpython3-stdlib)."
        )
    return "".join(parts)


class TextCodec:
    """Text to token ids and back: the model's tokenizer, or UTF-8 bytes.

    Args:
        tokenizer: a :class:`kvstore.model.Tokenizer`, or ``None`` for bytes.
        vocab_size: the model's vocabulary (bytes need ids 0-255).
        readable: whether the model's answers are text (False for seeded weights).

    Raises:
        ModelLoadError: no tokenizer and a vocabulary smaller than 256.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, *, readable: bool = True) -> None:
        if tokenizer is None and vocab_size < 256:
            raise ModelLoadError(
                f"[demo] The model has no tokenizer and a vocabulary of {vocab_size} ids; the "
                f"demo then encodes text as bytes, which needs 256. Give a model directory "
                f"with tokenizer files (and install 'mlx-kvstore[tokenizers]').",
                vocab_size=vocab_size,
            )
        self.tokenizer = tokenizer
        self.readable = readable
        self.stop_tokens: list[int] = sorted(getattr(tokenizer, "eos_token_ids", ()))
        self.kind = "bytes (UTF-8)" if tokenizer is None else f"tokenizer ({tokenizer.backend})"

    def encode(self, text: str, *, first: bool = False) -> list[int]:
        """Token ids of ``text``; ``first`` adds the tokenizer's special tokens (BOS)."""
        if self.tokenizer is None:
            return list(text.encode("utf-8"))
        return list(self.tokenizer.encode(text, add_special_tokens=first))

    def decode(self, ids: Sequence[int]) -> str | None:
        """``ids`` as text without end-of-text tokens, or ``None`` when the answers
        are not text (seeded weights)."""
        if not self.readable:
            return None
        ids = [i for i in ids if i not in self.stop_tokens]
        if self.tokenizer is None:
            return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))
