"""Shared helpers for the model tests: tiny mlx-lm model directories, teacher-forced runs."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from kvstore.model.generate import prefill

PREFILL, DECODE = 128, 16


def prompt_tokens(seed: int = 1, n: int = PREFILL + DECODE, vocab: int = 256) -> mx.array:
    return mx.random.randint(0, vocab, (n,), key=mx.random.key(seed))


def teacher_forced(model, caches, tokens, chunks=None):
    """Logits ``[1 + DECODE, vocab]``: the last prefill position (one chunk, or
    ``chunks`` through our prefill), then DECODE single-token steps fed from ``tokens``."""
    if chunks is None:
        out = [model(tokens[None, :PREFILL], cache=caches)[0, -1:]]
    else:
        out = [prefill(model, tokens, caches, chunks)]
    for i in range(PREFILL, PREFILL + DECODE):
        out.append(model(tokens[None, i : i + 1], cache=caches)[0, -1:])
    result = mx.concatenate(out, axis=0)
    mx.eval(result)
    return result


def rel_err(a: mx.array, b: mx.array) -> float:
    """max |a - b| relative to max |b|."""
    assert a.shape == b.shape, (a.shape, b.shape)
    return (mx.abs(a - b).max() / mx.abs(b).max()).item()


def save_mlx_lm_dir(path: Path, model, config: dict, shards: int = 1) -> Path:
    """Write ``model`` as an mlx-lm model directory (config.json + safetensors,
    ``shards`` files with an index when > 1), with mlx-lm's own config writer."""
    from mlx_lm.utils import save_config

    path.mkdir(parents=True, exist_ok=True)
    weights = dict(tree_flatten(model.parameters()))
    names = sorted(weights)
    if shards == 1:
        mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    else:
        weight_map = {}
        for i in range(shards):
            file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: weights[n] for n in names[i::shards]}
            mx.save_safetensors(str(path / file), part, metadata={"format": "mlx"})
            weight_map.update({n: file for n in part})
        (path / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map})
        )
    save_config(dict(config), path / "config.json")
    return path


@pytest.fixture
def mlx_lm():
    return pytest.importorskip("mlx_lm")
