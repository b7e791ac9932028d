"""Whether TurboQuant's CUDA kernels may run here: their switch, and a CUDA default device.

Each kernel module has its own environment switch (``"0"``: never; anything else,
or unset: wherever the kernel is proven) and runs only where MLX's default device
is a CUDA GPU.
"""

from __future__ import annotations

from kvstore.devices import default_is_cuda
from kvstore.knobs import switch_from_env

__all__ = ["switched_on"]


def switched_on(env: str) -> bool:
    """``env`` is not ``"0"`` and the default device is a CUDA GPU."""
    if not switch_from_env(env):
        return False
    return default_is_cuda()
