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


@pytest.fixture
def registries_restored():
    """The family and codec registries (and the signature caches) as they were
    before the test: for tests that register families or codecs of their own."""
    from kvstore import family as family_module
    from kvstore.abc.cache import _canonical
    from kvstore.codecs import registry as registry_module
    from kvstore.signature import _parse_cached

    families = dict(family_module._FAMILIES)
    codecs, instances = dict(registry_module._CODECS), dict(registry_module._INSTANCES)
    yield
    family_module._FAMILIES.clear()
    family_module._FAMILIES.update(families)
    registry_module._CODECS.clear()
    registry_module._CODECS.update(codecs)
    registry_module._INSTANCES.clear()
    registry_module._INSTANCES.update(instances)
    _parse_cached.cache_clear()
    _canonical.cache_clear()
