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
    # Not in the spec (its tq v1 stops at 4 bits): the 32-level Lloyd-Max quantizer's
    # figures, as its table gives them (issue 17).
    5: (
        0.002505,
        4.730,
        [
            *(0.052496, 0.051889, 0.050682, 0.048890, 0.046533, 0.043644, 0.040259, 0.036430),
            *(0.032217, 0.027694, 0.022955, 0.018114, 0.013315, 0.008749, 0.004672, 0.001461),
        ],
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


def test_mse_over_the_lower_bound_rises_towards_panter_dite():
    # The spec's ratios to the Theorem-3 bound 4^-b (1.454, 1.880, 2.211, 2.432) rise
    # towards the high-resolution limit sqrt(3)*pi/2; a wider table must continue the rise.
    ratios = [codebook(b).mse_per_coordinate() * 4**b for b in CODEBOOK_BITS]
    assert ratios[:4] == pytest.approx([1.454, 1.880, 2.211, 2.432], abs=1e-3)
    assert all(a < b for a, b in zip(ratios, ratios[1:]))
    assert ratios[-1] < math.sqrt(3) * math.pi / 2


def test_printed_thresholds_match_spec():
    assert codebook(3).thresholds[4:].tolist() == pytest.approx(
        [0.0 + 0.500549730, 1.049957280, 1.747927492], abs=1e-9
    )
    assert codebook(4).thresholds[8:].tolist() == pytest.approx(
        [0.258221665, 0.522403709, 0.799549788, 1.099285827, 1.437138792, 1.843531806, 2.400803399],
        abs=1e-9,
    )


@pytest.mark.parametrize("bits", [0, 6, 8, "4"])
def test_unknown_width_is_refused(bits):
    with pytest.raises(
        ValueError, match=r"\[turboquant.codebook\] bits must be one of 1, 2, 3, 4, 5; received"
    ):
        codebook(bits)
