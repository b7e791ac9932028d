"""Tiny offline mlx-lm model directories (weights, byte-level tokenizer, chat template),
written once per session, and their loaded models."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("mlx_lm")

from kvstore.testing.mlx_lm_models import write_model_dir  # noqa: E402

ARCHS = ("llama", "qwen3", "gemma3_text", "phi3", "qwen3_next")


@pytest.fixture(scope="session", autouse=True)
def private_digest_cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVSTORE_CACHE_DIR", str(tmp_path_factory.mktemp("digests")))
        yield


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {arch: write_model_dir(root / arch, arch) for arch in ARCHS}


_LOADED: dict[str, tuple] = {}


@pytest.fixture(scope="session")
def load(model_dirs):
    """``load(arch) -> (model, tokenizer)``, each loaded once."""
    import mlx_lm

    def get(arch: str):
        if arch not in _LOADED:
            _LOADED[arch] = mlx_lm.load(str(model_dirs[arch]))
        return _LOADED[arch]

    return get
