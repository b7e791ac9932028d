"""kvstore.mlx_lm's mlx-lm version check: a tested release passes, any other is refused
with what is installed and what would fix it."""

from __future__ import annotations

import sys

import pytest

from kvstore.errors import CapabilityError
from kvstore.mlx_lm import check_mlx_lm_version
from kvstore.mlx_lm import version as V
from tests.markers import needs_tested_mlx_lm


@needs_tested_mlx_lm
def test_a_tested_mlx_lm_passes_the_version_check():
    assert check_mlx_lm_version() == V.mlx_lm_version()
    assert V.mlx_lm_is_tested()


def test_the_mlx_lm_version_is_checked_with_a_clear_message(monkeypatch):
    monkeypatch.setattr(V, "mlx_lm_version", lambda: "0.31.1")
    monkeypatch.setattr(V, "TESTED_MLX_LM_PYTHON", (3, 0))
    with pytest.raises(
        CapabilityError, match=r"mlx-lm 0.31.1 is installed; .*tested with mlx-lm>=0.32.2,<0.33.0"
    ) as info:
        check_mlx_lm_version("kvstore serve")
    assert info.value.found == "0.31.1" and str(info.value).startswith("[kvstore serve]")
    assert "pip install 'mlx-lm>=0.32.2,<0.33.0'" in str(info.value)
    # Under a Python the tested releases do not support, installing them is no fix.
    monkeypatch.setattr(V, "TESTED_MLX_LM_PYTHON", (99, 0))
    now = ".".join(map(str, sys.version_info[:2]))
    with pytest.raises(CapabilityError, match=rf"needs Python >= 99.0 and this is {now}: run"):
        check_mlx_lm_version("kvstore serve")
    monkeypatch.setattr(V, "mlx_lm_version", lambda: None)
    with pytest.raises(CapabilityError, match=r"not installed; .*needs Python >= 99.0 and"):
        check_mlx_lm_version()
    monkeypatch.setattr(V, "TESTED_MLX_LM_PYTHON", (3, 0))
    with pytest.raises(CapabilityError, match=r"not installed; install it with pip install"):
        check_mlx_lm_version()
