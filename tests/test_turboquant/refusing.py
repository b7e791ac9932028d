"""Kernels switched on where they cannot build (a GPU whose compiler refuses them)."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import mlx.core as mx


def refuse(monkeypatch: Any, module: ModuleType, launchers: tuple[str, ...]) -> list[Any]:
    """Switch ``module``'s kernels on, make each of its ``launchers`` raise as a kernel
    that does not build, and forget its proofs; returns the launches tried."""
    launches: list[Any] = []

    def refused(*args: Any) -> None:
        launches.append(args)
        raise RuntimeError("[cuda_kernel] no CUDA here")

    monkeypatch.setattr(module, "enabled", lambda: True)
    for name in launchers:
        monkeypatch.setattr(module, name, refused)
    monkeypatch.setattr(module, "_PROVEN", {})
    return launches


def sample(seed: int) -> mx.array:
    """Keys of 40 tokens, 2 heads of 128, bfloat16."""
    return mx.random.normal((1, 2, 40, 128), key=mx.random.key(seed)).astype(mx.bfloat16)
