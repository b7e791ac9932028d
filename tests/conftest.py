import os

import mlx.core as mx
import pytest
from hypothesis import HealthCheck, settings

# The suite runs on MLX's CPU device everywhere; Metal-only tests are marked `metal`.
mx.set_default_device(mx.cpu)

settings.register_profile("default", max_examples=100, deadline=None)
settings.register_profile(
    "ci",
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=True,
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


@pytest.fixture(autouse=True)
def _seed_mlx():
    mx.random.seed(0)
