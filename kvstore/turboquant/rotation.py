"""The orthogonal rotation R that makes a vector's coordinates near-Gaussian.

Power-of-two head dims use a randomised Hadamard transform (RHT):
``R(x) = H_D (s * x) / sqrt(D)``, with ``s`` a +-1 sign vector drawn from
SplitMix64 and ``H_D`` the natural-order Sylvester matrix, which is exactly
``mx.hadamard_transform(x, scale=1/sqrt(D))``. Other head dims (80, 96, ...)
use a dense random orthogonal matrix; MLX's Hadamard for those sizes is not
symmetric, so it would not be its own inverse. Either way the sign vectors or
the matrix are what a record stores: the seed is informative only.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import mlx.core as mx
import numpy as np

__all__ = [
    "KIND_INDEX",
    "Rotation",
    "dense_rotation_matrix",
    "is_power_of_two",
    "rotation_for",
    "sign_vector",
    "splitmix64",
]

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_STREAM = 0xD1B54A32D192ED03

#: The spec's ``kind`` number: keys and values draw independent rotations.
KIND_INDEX: dict[str, int] = {"k": 0, "v": 1}


def splitmix64(state: int) -> Iterator[int]:
    """The SplitMix64 stream after ``state`` (each output advances it once)."""
    while True:
        state = (state + _GOLDEN) & _MASK64
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        yield z ^ (z >> 31)


def sign_vector(dim: int, seed: int = 0, kind: str = "k", round_: int = 0) -> np.ndarray:
    """The spec's +-1 vector (int8) for one RHT round: the top bit of each
    SplitMix64 output from ``seed + 0xD1B54A32D192ED03 * (1 + 2*round + kind)``."""
    state = (seed + _STREAM * (1 + 2 * round_ + KIND_INDEX[kind])) & _MASK64
    stream = splitmix64(state)
    return np.array([1 - 2 * (next(stream) >> 63) for _ in range(dim)], dtype=np.int8)


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def dense_rotation_matrix(dim: int, seed: int = 0, kind: str = "k") -> np.ndarray:
    """The reference dense rotation (float32 [D, D]): QR of a standard-normal
    matrix from ``default_rng(seed ^ kind)``, columns sign-fixed by diag(R).

    Only a writer calls this: LAPACK and RNG bits differ across platforms, so
    readers use the stored matrix, never a regenerated one.
    """
    rng = np.random.default_rng(seed ^ KIND_INDEX[kind])
    q, r = np.linalg.qr(rng.standard_normal((dim, dim)))
    return (q * np.sign(np.diag(r))).astype(np.float32)


@dataclass(frozen=True, eq=False)
class Rotation:
    """R and R^-1 along the last axis, float32 in and out.

    Exactly one of ``signs`` (int8 [rounds, D], the ``rht`` method) and
    ``matrix`` (float32 [D, D], ``dense``; ``R(x) = matrix @ x``) is set.
    """

    dim: int
    signs: np.ndarray | None = None
    matrix: np.ndarray | None = None

    def __post_init__(self) -> None:
        if (self.signs is None) == (self.matrix is None):
            raise ValueError("[turboquant.rotation] give exactly one of signs and matrix.")
        if self.signs is not None:
            if (
                not is_power_of_two(self.dim)
                or self.signs.ndim != 2
                or self.signs.shape[1] != self.dim
            ):
                raise ValueError(
                    f"[turboquant.rotation] rht needs a power-of-two dim and signs "
                    f"[rounds, {self.dim}]; received dim {self.dim}, signs {self.signs.shape}."
                )
            object.__setattr__(self, "_signs", [mx.array(s.astype(np.float32)) for s in self.signs])
        else:
            assert self.matrix is not None
            if self.matrix.shape != (self.dim, self.dim):
                raise ValueError(
                    f"[turboquant.rotation] dense needs a [{self.dim}, {self.dim}] matrix; "
                    f"received {self.matrix.shape}."
                )
            m = mx.array(self.matrix.astype(np.float32))
            forward = m.T
            # Rotations are shared across threads (rotation_for caches them); MLX evaluates
            # a graph only on the thread whose stream built it, so nothing stays lazy here.
            mx.eval(forward)
            object.__setattr__(self, "_forward_t", forward)  # x @ M^T == (M x) per row
            object.__setattr__(self, "_inverse_t", m)

    @property
    def method(self) -> Literal["rht", "dense"]:
        return "rht" if self.signs is not None else "dense"

    @property
    def rounds(self) -> int:
        return 0 if self.signs is None else int(self.signs.shape[0])

    def forward(self, x: mx.array) -> mx.array:
        """``R(x)`` for each row of ``x`` (float32, last axis D)."""
        if self.signs is None:
            return x @ self._forward_t  # type: ignore[attr-defined]
        scale = 1.0 / math.sqrt(self.dim)
        for s in self._signs:  # type: ignore[attr-defined]
            x = mx.hadamard_transform(x * s, scale=scale)
        return x

    def inverse(self, y: mx.array) -> mx.array:
        """``R^-1(y) = R^T(y)`` for each row of ``y`` (float32, last axis D)."""
        if self.signs is None:
            return y @ self._inverse_t  # type: ignore[attr-defined]
        scale = 1.0 / math.sqrt(self.dim)
        for s in reversed(self._signs):  # type: ignore[attr-defined]
            y = mx.hadamard_transform(y, scale=scale) * s
        return y


@functools.lru_cache(maxsize=64)
def rotation_for(dim: int, kind: str = "k", seed: int = 0, rounds: int = 1) -> Rotation:
    """The spec's rotation for ``(kind, dim)``: RHT with ``rounds`` sign vectors
    for power-of-two ``dim``, else the dense reference matrix. Shared by every
    layer and head (cached per process).

    Raises:
        ValueError: ``kind`` is not ``"k"``/``"v"``, ``rounds`` not 1 or 2, or
            ``dim`` not positive.
    """
    if kind not in KIND_INDEX:
        raise ValueError(f"[turboquant.rotation] kind must be 'k' or 'v'; received {kind!r}.")
    if rounds not in (1, 2):
        raise ValueError(f"[turboquant.rotation] rounds must be 1 or 2; received {rounds!r}.")
    if not (isinstance(dim, int) and dim > 0):
        raise ValueError(f"[turboquant.rotation] dim must be a positive int; received {dim!r}.")
    if is_power_of_two(dim):
        signs = np.stack([sign_vector(dim, seed, kind, r) for r in range(rounds)])
        return Rotation(dim, signs=signs)
    return Rotation(dim, matrix=dense_rotation_matrix(dim, seed, kind))
