"""Which device MLX computes on by default: asked here, in one place."""

from __future__ import annotations

import mlx.core as mx

__all__ = ["default_is_cuda"]


def default_is_cuda() -> bool:
    """Whether MLX's default device is a CUDA GPU (sets nothing up; ``False`` on a build
    without CUDA)."""
    try:
        return bool(mx.default_device() == mx.gpu and mx.cuda.is_available())
    except (AttributeError, RuntimeError):
        return False
