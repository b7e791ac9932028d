"""The stand-in CUDA transports (a tool's, the tests') do everything the real one
does: a method the protocol gains and a stand-in lacks would fail only where the
route reaches it (as the assemble kernel's did in tools.bench.restore_python)."""

from __future__ import annotations

import pytest

from kvstore.codecs import cuda
from tests.test_codecs.test_cuda_staging import HostTransport
from tools.bench.restore_python import FreeTransport

PROTOCOL = sorted(name for name in vars(cuda.Transport) if not name.startswith("_"))


@pytest.mark.parametrize("stand_in", [FreeTransport, HostTransport, cuda.KernelTransport])
def test_every_transport_has_every_method_of_the_protocol(stand_in):
    assert "assemble" in PROTOCOL and "gather" in PROTOCOL
    missing = [name for name in PROTOCOL if not callable(getattr(stand_in, name, None))]
    assert missing == []
