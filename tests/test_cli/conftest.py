"""Fixtures for the CLI tests: LMDB stores of real records, built once and copied per test."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.codecs.record import verify_record
from kvstore.store import keys as K
from kvstore.store import open_backend, open_store

from .stores import BLOCK, model_for, prompts, save_prompt

ROOT = Path(__file__).resolve().parents[2]


def build_store(path: Path, model_name: str, n: int, length: int, block: int) -> Path:
    model = model_for(model_name)
    with open_store(f"lmdb://{path}", block_size=block, verify=verify_record) as store:
        for p in prompts(n, length, shared=length // 2):
            save_prompt(store, model, p)
    return path


@pytest.fixture(scope="session")
def templates(tmp_path_factory):
    """Built once: ``tiny`` (2 global layers, 3 prompts of 70 tokens, 16-token blocks),
    ``gemma`` (2 sliding + 1 global layer), ``big`` (64-token blocks, for sizes) and
    ``many`` (~150 small blocks: a migration slow enough to be killed midway)."""
    root = tmp_path_factory.mktemp("templates")
    return {
        "tiny": build_store(root / "tiny", "tiny", 3, 70, BLOCK),
        "gemma": build_store(root / "gemma", "tiny-gemma3", 3, 90, BLOCK),
        "big": build_store(root / "big", "tiny", 2, 320, 64),
        "many": build_store(root / "many", "tiny-gemma3", 12, 208, BLOCK),
    }


@pytest.fixture
def make_store(templates, tmp_path):
    """``make_store("tiny")`` -> a private copy of that template store (a Path)."""

    def make(name: str = "tiny") -> Path:
        target = tmp_path / f"{name}-{len(list(tmp_path.iterdir()))}"
        shutil.copytree(templates[name], target, ignore=shutil.ignore_patterns("lock.mdb"))
        return target

    return make


def raw_items(path: Path) -> dict[bytes, bytes]:
    """Every key and value of the LMDB store at ``path``, read bypassing the store."""
    backend = open_backend(f"lmdb://{path}", readonly=True)
    try:
        with backend.reader() as view:
            return {k: bytes(v) for k, v in view.scan(b"kvstore/")}
    finally:
        backend.close()


def content(path: Path) -> dict[bytes, bytes]:
    """:func:`raw_items` without the meta record (it carries its creation time)."""
    return {k: v for k, v in raw_items(path).items() if k not in K.META_KEYS}


def kvstore_cli(*args: str, check: bool = False, **kw) -> subprocess.CompletedProcess:
    """Run ``python -m kvstore.cli ARGS`` in a fresh process."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "kvstore.cli", *args],
        capture_output=True,
        text=True,
        check=check,
        env=env,
        cwd=ROOT,
        **kw,
    )
