"""Level 0: the Lloyd-Max tables reproduce and are the Lloyd fixed point."""

import math

import numpy as np
import pytest

from kvstore.turboquant.codebook import CODEBOOK_BITS, codebook, gaussian_cell_mean, lloyd_max

# The spec's table: MSE per coordinate, index entropy (bits), positive-half cell probabilities.
SPEC = {
    1: (0.363380, 1.000, [0.5]),
    2: (0.117482, 1.911, [0.336851, 0.163149]),
    3: (0.034548, 2.825, [0.191656, 0.161475, 0.106631, 0.040238]),
    4: (
        0.009501,
        3.765,
        [0.101882, 0.097423, 0.088709, 0.076164, 0.060482, 0.042714, 0.024446, 0.008180],
    ),
}


@pytest.mark.parametrize("bits", CODEBOOK_BITS)
def test_table_is_lloyd_max_derived_from_scratch(bits):
    assert np.max(np.abs(lloyd_max(bits) - codebook(bits).centroids)) < 1e-6


@pytest.mark.parametrize("bits", CODEBOOK_BITS)
def test_lloyd_fixed_point(bits):
    table = codebook(bits)
    edges = [-math.inf, *table.thresholds, math.inf]
    means = [gaussian_cell_mean(a, b) for a, b in zip(edges[:-1], edges[1:])]
    assert np.max(np.abs(np.array(means) - table.centroids)) < 1e-6
    assert np.allclose(table.thresholds, (table.centroids[:-1] + table.centroids[1:]) / 2)
    assert np.array_equal(table.centroids, -table.centroids[::-1])  # odd-symmetric
    assert len(table.centroids) == 1 << bits and np.all(np.diff(table.centroids) > 0)


@pytest.mark.parametrize("bits", CODEBOOK_BITS)
def test_mse_probabilities_and_entropy_match_spec(bits):
    mse, entropy, positive_half = SPEC[bits]
    table = codebook(bits)
    assert table.mse_per_coordinate() == pytest.approx(mse, abs=1e-6)
    p = table.cell_probabilities()
    assert p.sum() == pytest.approx(1.0, abs=1e-12)
    assert np.max(np.abs(p[len(p) // 2 :] - positive_half)) < 1e-6
    assert -(p * np.log2(p)).sum() == pytest.approx(entropy, abs=1e-3)


def test_printed_thresholds_match_spec():
    assert codebook(3).thresholds[4:].tolist() == pytest.approx(
        [0.0 + 0.500549730, 1.049957280, 1.747927492], abs=1e-9
    )
    assert codebook(4).thresholds[8:].tolist() == pytest.approx(
        [0.258221665, 0.522403709, 0.799549788, 1.099285827, 1.437138792, 1.843531806, 2.400803399],
        abs=1e-9,
    )


@pytest.mark.parametrize("bits", [0, 5, 8, "4"])
def test_unknown_width_is_refused(bits):
    with pytest.raises(ValueError, match=r"\[turboquant.codebook\] bits must be one of 1, 2, 3, 4"):
        codebook(bits)
