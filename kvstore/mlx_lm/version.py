"""The mlx-lm releases this integration is tested with, enforced where it starts.

:mod:`kvstore.mlx_lm` subclasses mlx-lm's ``LRUPromptCache`` and ``kvstore serve``
builds on ``mlx_lm.server``'s classes (its request handler, response
generator and model provider), which are not a stable API: a release outside
the tested range may change them under us. The range is checked once, at
start, with a message that says what is installed and what to install.
"""

from __future__ import annotations

import sys

from kvstore.errors import CapabilityError
from kvstore.mlx_lm_installed import mlx_lm_version, version_tuple

__all__ = [
    "TESTED_MLX_LM",
    "TESTED_MLX_LM_RANGE",
    "mlx_lm_version",
    "check_mlx_lm_version",
    "mlx_lm_is_tested",
]

#: ``(lowest, first untested)``: the releases the integration and the server are tested with.
TESTED_MLX_LM: tuple[tuple[int, int, int], tuple[int, int, int]] = ((0, 32, 2), (0, 33, 0))
#: The Python the tested mlx-lm releases need (mlx-lm 0.32 dropped 3.10).
TESTED_MLX_LM_PYTHON = (3, 11)


def _dotted(version: tuple[int, ...]) -> str:
    return ".".join(map(str, version))


#: :data:`TESTED_MLX_LM` as a pip version specifier.
TESTED_MLX_LM_RANGE = f">={_dotted(TESTED_MLX_LM[0])},<{_dotted(TESTED_MLX_LM[1])}"


def check_mlx_lm_version(operation: str = "kvstore.mlx_lm") -> str:
    """The installed mlx-lm version, if inside :data:`TESTED_MLX_LM`.

    Raises:
        CapabilityError: mlx-lm is missing, or its version is outside the tested
            range (``exc.found``, ``exc.supported``).
    """
    wanted = TESTED_MLX_LM_RANGE
    found = mlx_lm_version()
    if found is None:
        raise CapabilityError(
            f"[{operation}] mlx-lm is not installed; "
            + _remedy(f"install it with pip install 'mlx-kvstore[serve]' (mlx-lm{wanted})."),
            found=None,
            supported=wanted,
        )
    if not _tested(found):
        raise CapabilityError(
            f"[{operation}] mlx-lm {found} is installed; this kvstore is tested with "
            f"mlx-lm{wanted} (it builds on mlx-lm's prompt cache and server internals). "
            + _remedy(f"Install a tested release: pip install 'mlx-lm{wanted}'."),
            found=found,
            supported=wanted,
        )
    return found


def mlx_lm_is_tested() -> bool:
    """Whether the installed mlx-lm is one of :data:`TESTED_MLX_LM`'s releases."""
    found = mlx_lm_version()
    return found is not None and _tested(found)


def _tested(version: str) -> bool:
    low, high = TESTED_MLX_LM
    return low <= version_tuple(version) < high


def _remedy(install: str) -> str:
    """``install``, unless this Python is older than the tested releases need: then that."""
    if sys.version_info[:2] >= TESTED_MLX_LM_PYTHON:
        return install
    return (
        f"mlx-lm{TESTED_MLX_LM_RANGE} needs Python >= {_dotted(TESTED_MLX_LM_PYTHON)} and "
        f"this is {_dotted(sys.version_info[:2])}: run kvstore under a newer Python."
    )
