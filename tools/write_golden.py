"""Write the golden record fixtures under tests/fixtures/golden/<name>/format-<N>/.

Golden fixtures pin the on-disk format: CI decodes them on every run (see
``kvstore.testing.codec.check_golden``), so a reader that stops reading what
an earlier kvstore wrote fails a test. They are written once, by running::

    .venv/bin/python tools/write_golden.py --write-golden

which writes only fixture directories that do not exist yet (a new format
version gets a new ``format-<N>`` directory beside the old ones); it never
rewrites one. Each fixture feeds seeded rows to a few caches in chunks, and
stores one record per block of tokens -- every layer of the block in one
record, as the prefix store does -- plus what each record and each cache
should hold.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import mlx.core as mx

from kvstore import caches as families
from kvstore.abc.cache import is_recurrent_cache
from kvstore.abc.codec import Snapshot
from kvstore.codecs import encode_record, snapshot, snapshot_held
from kvstore.codecs.header import FORMAT_VERSION
from kvstore.codecs.ring import window_positions
from kvstore.testing.codec import GOLDEN_RECORD_SUFFIX, random_kv

ROOT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "golden"
HEADS = 2
#: Token blocks: each list is the updates that fill one block (the last
#: block is decoded token by token, so windowed caches wrap and rotate).
BLOCKS = [[16], [16], [16], [1, 1, 1]]

#: name -> description and layers (cache class, its arguments, dtype, head_dim).
FIXTURES: dict[str, dict[str, Any]] = {
    "kv-plain": {
        "description": "kv:plain, float16 and bfloat16",
        "layers": [
            ("KVCache", {}, "float16", 64),
            ("KVCache", {}, "bfloat16", 128),
        ],
    },
    "kv-quant": {
        "description": "kv:quant 4/64 (bfloat16, head_dim 128) and 3/32 (float16)",
        "layers": [
            ("QuantizedKVCache", {"group_size": 64, "bits": 4}, "bfloat16", 128),
            ("QuantizedKVCache", {"group_size": 32, "bits": 3}, "float16", 64),
        ],
    },
    "kv-rotating-plain": {
        "description": "kv:rotating-plain, window 32 keep 4 and window 16 keep 0, wrapped",
        "layers": [
            ("RotatingKVCache", {"max_size": 32, "keep": 4}, "float16", 64),
            ("RotatingKVCache", {"max_size": 16, "keep": 0}, "bfloat16", 64),
        ],
    },
    "kv-rotating-quant": {
        "description": "kv:rotating-quant 4/64 keep 4 and 8/32 keep 0, wrapped",
        "layers": [
            ("RotatingQuantizedKVCache", {"max_size": 32, "keep": 4, "bits": 4}, "bfloat16", 64),
            (
                "RotatingQuantizedKVCache",
                {"max_size": 16, "keep": 0, "bits": 8, "group_size": 32},
                "float16",
                64,
            ),
        ],
    },
    "kv-turboquant": {
        "description": (
            "kv:turboquant 4/3 (bfloat16, head_dim 128, RHT) and 2/2 seed 7 with key "
            "mean-centering (float16, head_dim 96: the dense rotation, carried by record 0)"
        ),
        "layers": [
            ("TurboQuantKVCache", {"kbits": 4, "vbits": 3}, "bfloat16", 128),
            (
                "TurboQuantKVCache",
                {"kbits": 2, "vbits": 2, "seed": 7, "center": True},
                "float16",
                96,
            ),
        ],
    },
    # 5-bit codes (issue 17; beyond the spec's 2-4): exact packing at D=128, a padded
    # last word at D=80 (13 words), and the dense rotation there.
    "kv-turboquant-5bit": {
        "description": (
            "kv:turboquant 5/4 (bfloat16, head_dim 128, RHT) and 3/5 seed 7 with key "
            "mean-centering (float16, head_dim 80: 13-word 5-bit rows, the dense rotation)"
        ),
        "layers": [
            ("TurboQuantKVCache", {"kbits": 5, "vbits": 4}, "bfloat16", 128),
            (
                "TurboQuantKVCache",
                {"kbits": 3, "vbits": 5, "seed": 7, "center": True},
                "float16",
                80,
            ),
        ],
    },
    "kv-rotating-turboquant": {
        "description": (
            "kv:rotating-turboquant 3/3 window 32 keep 4 (head_dim 96) and 4/2 window 16 "
            "keep 0 with 2 RHT rounds (head_dim 64), wrapped"
        ),
        "layers": [
            (
                "RotatingTurboQuantKVCache",
                {"max_size": 32, "keep": 4, "kbits": 3, "vbits": 3},
                "bfloat16",
                96,
            ),
            (
                "RotatingTurboQuantKVCache",
                {"max_size": 16, "keep": 0, "kbits": 4, "vbits": 2, "rounds": 2},
                "float16",
                64,
            ),
        ],
    },
    "kv-mxfp8": {
        "description": "kv:mxfp8 (bfloat16, head_dim 128; float16, head_dim 64)",
        "layers": [
            ("MXFP8KVCache", {}, "bfloat16", 128),
            ("MXFP8KVCache", {}, "float16", 64),
        ],
    },
    "kv-rotating-mxfp8": {
        "description": "kv:rotating-mxfp8 window 32 keep 4 and window 16 keep 0, wrapped",
        "layers": [
            ("RotatingMXFP8KVCache", {"max_size": 32, "keep": 4}, "bfloat16", 64),
            ("RotatingMXFP8KVCache", {"max_size": 16, "keep": 0}, "float16", 64),
        ],
    },
    "kv-mxfp4": {
        "description": "kv:mxfp4 (bfloat16, head_dim 128; float16, head_dim 96)",
        "layers": [
            ("MXFP4KVCache", {}, "bfloat16", 128),
            ("MXFP4KVCache", {}, "float16", 96),
        ],
    },
    "kv-rotating-mxfp4": {
        "description": "kv:rotating-mxfp4 window 32 keep 4 and window 16 keep 0, wrapped",
        "layers": [
            ("RotatingMXFP4KVCache", {"max_size": 32, "keep": 4}, "bfloat16", 64),
            ("RotatingMXFP4KVCache", {"max_size": 16, "keep": 0}, "float16", 64),
        ],
    },
    "kv-nvfp4": {
        "description": "kv:nvfp4 (bfloat16, head_dim 128; float16, head_dim 80)",
        "layers": [
            ("NVFP4KVCache", {}, "bfloat16", 128),
            ("NVFP4KVCache", {}, "float16", 80),
        ],
    },
    "kv-rotating-nvfp4": {
        "description": "kv:rotating-nvfp4 window 32 keep 4 and window 16 keep 0, wrapped",
        "layers": [
            ("RotatingNVFP4KVCache", {"max_size": 32, "keep": 4}, "bfloat16", 64),
            ("RotatingNVFP4KVCache", {"max_size": 16, "keep": 0}, "float16", 64),
        ],
    },
    # Recurrent state (issue 16): a checkpoint at a block's end, in the records of
    # blocks 1 and 3 only (the others carry None for the layer); beside a KV layer.
    "rec-gated-delta": {
        "description": (
            "rec:gated-delta (conv window bfloat16 [1, 3, 96], state float32 [1, 4, 16, 16]) "
            "checkpointed at the ends of blocks 1 and 3, beside a kv:plain layer"
        ),
        "checkpoint_blocks": [1, 3],
        "layers": [
            ("GatedDeltaCache", {}, "bfloat16", {"conv": [1, 3, 96], "state": [1, 4, 16, 16]}),
            ("KVCache", {}, "bfloat16", 64),
        ],
    },
    "rec-arrays": {
        "description": (
            "rec:arrays:3 (mlx-lm's ArraysCache: slot 0 float16 [1, 3, 40], slot 1 float32 "
            "[1, 2, 8, 8], slot 2 empty) checkpointed at the ends of blocks 1 and 3, beside "
            "a kv:plain layer"
        ),
        "checkpoint_blocks": [1, 3],
        "layers": [
            ("ArraysCache", {"size": 3}, "float16", {"slot.0": [1, 3, 40], "slot.1": [1, 2, 8, 8]}),
            ("KVCache", {}, "float16", 64),
        ],
    },
    "mixed": {
        "description": "a gemma-like layer stack: sliding and global layers in one record",
        "layers": [
            ("RotatingKVCache", {"max_size": 16}, "bfloat16", 64),
            ("KVCache", {}, "bfloat16", 64),
            ("RotatingQuantizedKVCache", {"max_size": 16, "bits": 8}, "bfloat16", 64),
            ("QuantizedKVCache", {"bits": 8}, "bfloat16", 64),
        ],
    },
}


def _advance_state(cache: Any, shapes: dict[str, list[int]], n: int, seed: int, dtype: str) -> None:
    """A recurrent cache ``n`` tokens on: seeded new arrays in its slots (the
    float32 state of a Gated-DeltaNet layer, the rest in ``dtype``)."""
    keys = mx.random.split(mx.random.key(seed), len(shapes))
    for slot, ((name, shape), key) in enumerate(zip(shapes.items(), keys)):
        kind = mx.float32 if name == "state" or name == "slot.1" else getattr(mx, dtype)
        cache[slot] = mx.random.normal(tuple(shape), key=key).astype(kind)
    cache.advance(n)


def build(
    name: str, spec: dict[str, Any]
) -> tuple[list[bytes], dict[str, mx.array], dict[str, Any]]:
    """The records, the expected tensors and the config of one fixture."""
    caches = [getattr(families, cls)(**kwargs) for cls, kwargs, _, _ in spec["layers"]]
    checkpointed = set(spec.get("checkpoint_blocks", ()))
    blocks: list[list[Snapshot | None]] = []
    start = 0
    for b, updates in enumerate(BLOCKS):
        for u, n in enumerate(updates):
            for i, (cache, (_, _, dtype, head_dim)) in enumerate(
                zip(caches, spec["layers"], strict=True)
            ):
                if isinstance(head_dim, dict):  # recurrent state: its arrays' shapes
                    _advance_state(cache, head_dim, n, 1000 * i + 10 * b + u, dtype)
                    continue
                kv = random_kv(
                    n,
                    seed=1000 * i + 10 * b + u,
                    heads=HEADS,
                    head_dim=head_dim,
                    dtype=getattr(mx, dtype),
                )
                cache.update_and_fetch(*kv)
        stop = start + sum(updates)
        blocks.append(
            [
                (snapshot(cache, stop, stop) if b in checkpointed else None)
                if is_recurrent_cache(cache)
                else snapshot(cache, start, stop)
                for cache in caches
            ]
        )
        start = stop
    # A store keeps a windowed layer's blocks only while its window needs them.
    for i, cache in enumerate(caches):
        if hasattr(cache, "max_size"):
            needed = window_positions(cache.offset, cache.max_size, cache.keep)
            for block in blocks:
                s = block[i]
                if not any(s.start < b and a < s.stop for a, b in needed):
                    block[i] = None
    records, expected, config_records = [], {}, []
    for k, block in enumerate(blocks):
        first = next(s for s in block if s is not None)
        meta = {"block": k, "tokens": [first.start, first.stop]}
        records.append(encode_record(block, meta=meta))
        entries = []
        for i, s in enumerate(block):
            if s is None:
                entries.append(None)
                continue
            entry = {"signature": s.signature, "tensors": list(s.tensors), "meta": dict(s.meta)}
            if (s.start, s.stop) != (first.start, first.stop):  # a checkpoint: one position
                entry.update(start=s.start, stop=s.stop)
            entries.append(entry)
            expected.update({f"record.{k}.layer.{i}.{n}": a for n, a in s.tensors.items()})
        config_records.append(
            {"start": first.start, "stop": first.stop, "meta": meta, "layers": entries}
        )
    layers = []
    for i, (cache, (cls, kwargs, dtype, head_dim)) in enumerate(
        zip(caches, spec["layers"], strict=True)
    ):
        held = snapshot_held(cache)
        for j, s in enumerate(held):
            expected.update({f"held.layer.{i}.{j}.{n}": a for n, a in s.tensors.items()})
        layers.append(
            {
                "cache": cls,
                "args": kwargs,
                "dtype": dtype,
                "head_dim": head_dim,
                "signature": cache.signature(),
                "tensors": list(held[0].tensors),
                # Each held snapshot's own tensor names: a TurboQuant snapshot starting
                # at token 0 also carries a dense rotation.
                "held": [[s.start, s.stop, dict(s.meta), list(s.tensors)] for s in held],
            }
        )
    config = {
        "name": name,
        "format": FORMAT_VERSION,
        "description": spec["description"],
        "heads": HEADS,
        "blocks": BLOCKS,
        "layers": layers,
        "records": config_records,
    }
    return records, expected, config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write-golden", action="store_true", help="write missing fixtures")
    args = parser.parse_args(argv)
    for name, spec in FIXTURES.items():
        target = ROOT / name / f"format-{FORMAT_VERSION}"
        if target.exists():
            print(f"{target.relative_to(ROOT)}: exists, left as it is")
            continue
        if not args.write_golden:
            print(f"{target.relative_to(ROOT)}: missing (pass --write-golden to write it)")
            continue
        records, expected, config = build(name, spec)
        target.mkdir(parents=True)
        for k, record in enumerate(records):
            (target / f"record-{k}{GOLDEN_RECORD_SUFFIX}").write_bytes(record)
        mx.save_safetensors(str(target / "expected.safetensors"), expected)
        (target / "config.json").write_text(json.dumps(config, indent=1) + "\n")
        print(f"{target.relative_to(ROOT)}: written ({len(records)} records)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
