"""Stores of real records for the CLI tests, written the way a session saves.

A tiny seeded model prefills each prompt in block-sized chunks; after each
chunk, every layer's cache is snapshotted over the chunk's tokens (a sliding
window still holds them then), the layers go into one record per block
(:func:`~kvstore.codecs.record.encode_record`), and ``put_blocks`` stores the
blocks not stored yet. So the records are real encoded KV, as ``store.save``
will write them, and migrations really transcode.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np

from kvstore.codecs import decode_record_to_mlx, encode_record, restore, snapshot
from kvstore.model import build_model
from kvstore.model.generate import prefill, prefill_chunks
from kvstore.store.maintenance.transfer import family_label

NS = "tinyns"
BLOCK = 16


def model_for(name: str = "tiny") -> Any:
    return build_model(name, seed=0, dtype=mx.float16)


def prompts(n: int = 3, length: int = 70, shared: int = 40, seed: int = 0) -> list[list[int]]:
    """``n`` prompts sharing their first ``shared`` tokens (ids < 256)."""
    rng = np.random.default_rng(seed)
    head = rng.integers(0, 256, shared).tolist()
    return [head + rng.integers(0, 256, length - shared).tolist() for _ in range(n)]


def block_records(
    model: Any, tokens: Sequence[int], block: int = BLOCK, policy: Any = None
) -> dict:
    """``{(start, stop): record}`` for every block of ``tokens`` (the last one partial)."""
    caches = model.make_cache(policy)
    records: dict[tuple[int, int], bytes] = {}
    begin = [0]

    def capture(end: int, caches: list[Any]) -> None:
        start = begin[0]
        records[(start, end)] = encode_record([snapshot(c, start, end) for c in caches])
        begin[0] = end

    arr = mx.array(np.asarray(tokens, dtype=np.int32))
    prefill(model, arr, caches, prefill_chunks(0, len(tokens), block, block), capture)
    return records


def save_prompt(
    store: Any, model: Any, tokens: Sequence[int], namespace: str = NS, policy: Any = None
) -> Any:
    records = block_records(model, tokens, store.block_size, policy)
    first = next(iter(records.values()))
    from kvstore.codecs import read_header

    family = family_label(layer.signature for layer in read_header(first).layers)
    return store.put_blocks(
        namespace, tokens, lambda spans: [records[(s.start, s.stop)] for s in spans], family=family
    )


def restore_caches(store: Any, namespace: str, tokens: Sequence[int]) -> tuple[list[Any], int]:
    """Caches restored from the store for the longest stored prefix of ``tokens``."""
    match = store.lookup(namespace, tokens)
    with store.read(match.blocks) as views:
        assert len(views) == len(match.blocks)
        decoded = [decode_record_to_mlx(v) for v in views]
    layers = len(decoded[0].layers)
    caches = [restore([r.layers[i] for r in decoded]) for i in range(layers)]
    last = match.blocks[-1]
    if last.trimmed:
        for c in caches:
            c.trim(last.stored_rows - last.rows)
    return caches, match.tokens
