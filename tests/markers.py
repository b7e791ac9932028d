"""Skip markers more than one test package uses."""

from __future__ import annotations

import pytest

from kvstore.mlx_lm.version import (
    TESTED_MLX_LM_PYTHON,
    TESTED_MLX_LM_RANGE,
    mlx_lm_is_tested,
    mlx_lm_version,
)

#: What only a tested mlx-lm runs: kvstore's mlx-lm integration and server (its version
#: check refuses others), mlx-lm's file layout and batch classes as 0.32 has them. Python
#: 3.10 gets mlx-lm 0.31 at most (0.32 needs 3.11): there these skip, saying so.
needs_tested_mlx_lm = pytest.mark.skipif(
    not mlx_lm_is_tested(),
    reason=(
        f"needs mlx-lm{TESTED_MLX_LM_RANGE} (Python >= "
        f"{'.'.join(map(str, TESTED_MLX_LM_PYTHON))}); found mlx-lm {mlx_lm_version()}"
    ),
)
