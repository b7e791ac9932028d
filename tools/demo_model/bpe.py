"""The tokenizer: byte-level BPE trained with ``tokenizers``, and its mlx-lm files.

Byte-level (GPT-2's byte alphabet, all 256 bytes in the base vocabulary), so
any text round-trips, including non-ASCII and stray control characters.
``<|endoftext|>`` (id 0) separates documents: every encoding with special
tokens starts with it (the post-processor), and the model learns to end a
file with it, which makes it the end-of-sequence token too.

``tokenizer_config.json`` names it as BOS and EOS and carries a chat template
that writes the demo's questions, so ``mlx_lm.generate``/``mlx_lm.server`` can
format conversations the way ``kvstore demo`` does (:mod:`kvstore.demo.script`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["EOT", "CHAT_TEMPLATE", "train_tokenizer", "write_tokenizer_files", "encode_documents"]

EOT = "<|endoftext|>"


def _literal(text: str) -> str:
    """``text`` as a Jinja string literal."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n") + "'"


def chat_template() -> str:
    """A system message as comment lines, each question as the demo asks it (a new
    ``answers.py`` whose docstring is the question, after ``<|endoftext|>`` unless the
    conversation starts with it), each answer as the model wrote it.

    Built from :func:`kvstore.demo.script.question_text`, so the two cannot drift apart.
    Text with newlines is written as expressions: transformers renders with
    trim_blocks, which drops a newline that follows a block tag.
    """
    from kvstore.demo.script import Turn, question_text

    before, after = question_text(Turn("\x00")).split("\x00")
    return (
        "{{ bos_token }}"
        "{% for message in messages %}"
        "{% if message['role'] == 'system' %}"
        "{{ '# ' + message['content'] | replace('\\n', '\\n# ') + '\\n' }}"
        "{% elif message['role'] == 'user' %}"
        "{{ ('' if loop.first else bos_token) + "
        f"{_literal(before)} + message['content'] + {_literal(after)}"
        " }}"
        "{% else %}"
        "{{ message['content'] }}"
        "{% endif %}"
        "{% endfor %}"
    )


#: The template ``tokenizer_config.json`` carries (:func:`chat_template`).
CHAT_TEMPLATE = chat_template()


def train_tokenizer(texts: Sequence[str], vocab_size: int) -> Any:
    """A byte-level BPE ``tokenizers.Tokenizer`` of ``vocab_size`` ids trained on ``texts``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{EOT} $A", special_tokens=[(EOT, tokenizer.token_to_id(EOT))]
    )
    return tokenizer


def load_tokenizer(path: Path) -> Any:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))


def write_tokenizer_files(tokenizer: Any, out: Path, max_length: int) -> None:
    """``tokenizer.json`` and ``tokenizer_config.json`` (what transformers' AutoTokenizer,
    hence mlx-lm, and kvstore's loader read)."""
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOT,
        "eos_token": EOT,
        "pad_token": EOT,
        "unk_token": None,
        "add_bos_token": True,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def encode_documents(tokenizer: Any, documents: Sequence[str]) -> np.ndarray:
    """All documents as one stream of ids, each starting with ``<|endoftext|>``."""
    encodings = tokenizer.encode_batch(list(documents))
    if not encodings:
        return np.zeros(0, dtype=np.int32)
    return np.concatenate([np.asarray(e.ids, dtype=np.int32) for e in encodings])


def token_bytes(tokenizer: Any) -> np.ndarray:
    """Bytes of text each id stands for (0 for ``<|endoftext|>``): byte-level tokens
    spell one alphabet character per byte, so the length of the token's string."""
    vocab = tokenizer.get_vocab()
    sizes = np.zeros(tokenizer.get_vocab_size(), dtype=np.int64)
    for token, i in vocab.items():
        sizes[i] = 0 if token == EOT else len(token)
    return sizes
