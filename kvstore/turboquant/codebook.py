"""Lloyd-Max codebooks for the standard Gaussian (spec table ``gauss-lm-v1``).

TurboQuant rotates each vector so its coordinates are (nearly) i.i.d.
N(0, 1/D); scaled by ``sqrt(D)/||x||`` they are unit-variance, so one scalar
codebook per bit width serves every head dimension. The 1- to 4-bit tables
are Max's (1960) classical values, stored to nine digits as the spec prints
them; the 5-bit table is not in the spec (its ``tq`` v1 stops at 4 bits) and
is the Lloyd fixed point to nine digits, what :func:`lloyd_max` converges to
from a uniform start (tolerance 1e-13). :func:`lloyd_max`
re-derives every table from the Gaussian density so a test can prove each is
the Lloyd fixed point (each centroid the conditional mean of its cell, each
threshold the midpoint of its neighbours).

.. versionchanged:: 0.2 a 5-bit table, for ``kv:turboquant`` keys or values at
   5 bits (issue 17: a width between TurboQuant 4/4 and affine 4/32 to tune with).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

__all__ = [
    "CODEBOOK_ID",
    "CODEBOOK_BITS",
    "Codebook",
    "codebook",
    "gaussian_cell_mean",
    "lloyd_max",
]

#: The identifier written into metadata next to the stored table.
CODEBOOK_ID = "gauss-lm-v1"

#: The positive half of each table, ascending (the tables are odd-symmetric).
_POSITIVE_CENTROIDS: dict[int, tuple[float, ...]] = {
    1: (0.797884561,),
    2: (0.452780035, 1.510417608),
    3: (0.245094179, 0.756005281, 1.343909279, 2.151945705),
    4: (
        0.128395030,
        0.388048299,
        0.656759119,
        0.942340456,
        1.256231197,
        1.618046386,
        2.069017227,
        2.732589571,
    ),
    # Not in the spec: the Lloyd fixed point, lloyd_max(5) rounded to nine digits.
    5: (
        0.065889660,
        0.198051830,
        0.331378306,
        0.466699523,
        0.604933624,
        0.747135704,
        0.894565117,
        1.048783320,
        1.211804381,
        1.386340340,
        1.576228079,
        1.787233218,
        2.028728399,
        2.317739404,
        2.691119577,
        3.260732493,
    ),
}

#: Bit widths with a table (TurboQuant caches use 2 to 5).
CODEBOOK_BITS: tuple[int, ...] = tuple(_POSITIVE_CENTROIDS)


@dataclass(frozen=True)
class Codebook:
    """One unit-variance scalar quantizer: ``2**bits`` centroids and the
    ``2**bits - 1`` thresholds (midpoints) between them, ascending, float64."""

    bits: int
    centroids: np.ndarray
    thresholds: np.ndarray

    @property
    def levels(self) -> int:
        return 1 << self.bits

    def mse_per_coordinate(self) -> float:
        """E[(Z - Q(Z))^2] for Z ~ N(0, 1): the spec's "MSE / coord" column."""
        edges = [-math.inf, *self.thresholds.tolist(), math.inf]
        total = 0.0
        for c, a, b in zip(self.centroids.tolist(), edges[:-1], edges[1:]):
            # E[(Z - c)^2; a < Z < b] = m2 - 2c*m1 + c^2*p over the cell.
            p = _cdf(b) - _cdf(a)
            m1 = _pdf(a) - _pdf(b)
            m2 = p + _xpdf(a) - _xpdf(b)
            total += m2 - 2 * c * m1 + c * c * p
        return total

    def cell_probabilities(self) -> np.ndarray:
        """P(Z in cell i) for Z ~ N(0, 1), one per centroid."""
        edges = [-math.inf, *self.thresholds.tolist(), math.inf]
        return np.array([_cdf(b) - _cdf(a) for a, b in zip(edges[:-1], edges[1:])])


@functools.cache
def codebook(bits: int) -> Codebook:
    """The ``gauss-lm-v1`` table for ``bits`` (1 to 5).

    Raises:
        ValueError: no table for ``bits``.
    """
    if bits not in _POSITIVE_CENTROIDS:
        raise ValueError(
            f"[turboquant.codebook] bits must be one of "
            f"{', '.join(map(str, CODEBOOK_BITS))}; received {bits!r}."
        )
    half = np.array(_POSITIVE_CENTROIDS[bits], dtype=np.float64)
    centroids = np.concatenate([-half[::-1], half])
    thresholds = (centroids[:-1] + centroids[1:]) / 2
    centroids.flags.writeable = False
    thresholds.flags.writeable = False
    return Codebook(bits, centroids, thresholds)


# -- the Gaussian and its Lloyd iteration (float64, for checking the tables) ---------
def _pdf(x: float) -> float:
    return 0.0 if math.isinf(x) else math.exp(-x * x / 2) / math.sqrt(2 * math.pi)


def _xpdf(x: float) -> float:
    return 0.0 if math.isinf(x) else x * _pdf(x)


def _cdf(x: float) -> float:
    return 0.5 * math.erfc(-x / math.sqrt(2))


def gaussian_cell_mean(a: float, b: float) -> float:
    """E[Z | a < Z < b] for Z ~ N(0, 1): ``(pdf(a) - pdf(b)) / (cdf(b) - cdf(a))``."""
    return (_pdf(a) - _pdf(b)) / (_cdf(b) - _cdf(a))


def lloyd_max(bits: int, tol: float = 1e-13, max_iter: int = 200_000) -> np.ndarray:
    """Lloyd-Max centroids for N(0, 1) at ``bits``, iterated from a uniform start
    until no centroid moves by more than ``tol``."""
    levels = 1 << bits
    c = np.linspace(-2.0, 2.0, levels) if levels > 2 else np.array([-1.0, 1.0])
    for _ in range(max_iter):
        edges = [-math.inf, *((c[:-1] + c[1:]) / 2).tolist(), math.inf]
        new = np.array([gaussian_cell_mean(a, b) for a, b in zip(edges[:-1], edges[1:])])
        if np.max(np.abs(new - c)) < tol:
            return new
        c = new
    return c
