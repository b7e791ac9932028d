"""Which BLAS the demo's sessions run on, and the environment that picks the fast one.

The ``mlx[cpu]`` Linux wheel bundles the reference BLAS: the ``small`` model
prefills 4096 tokens in ~60 s with it and in ~6 s with Debian's OpenBLAS
preloaded (BENCHMARKS.md "The BLAS caveat"). Every model run of the demo
happens in a session process it starts, so choosing the fast path is only a
matter of the environment those processes get: ``LD_PRELOAD`` naming the
OpenBLAS ``libblas.so.3`` when it is installed and not preloaded already. Each
session reports the BLAS it really mapped (:func:`kvstore.bench.machine.blas_info`),
so what the demo prints is measured, not assumed.
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from kvstore.bench.machine import blas_info

__all__ = ["OPENBLAS", "BlasChoice", "choose_blas"]

#: Debian/Ubuntu's OpenBLAS drop-in ``libblas.so.3`` (package libopenblas0-pthread), by machine.
OPENBLAS: dict[str, str] = {
    "x86_64": "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3",
    "aarch64": "/usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3",
}

_INSTALL_HINT = "apt-get install libopenblas0-pthread makes prefill ~10x faster"


@dataclass(frozen=True)
class BlasChoice:
    """The BLAS the session processes are meant to run on.

    Attributes:
        fast: OpenBLAS (preloaded) or macOS; False for MLX's bundled reference BLAS.
        description: what was chosen and why, for the demo's output.
        env: the environment for session processes.
    """

    fast: bool
    description: str
    env: dict[str, str] = field(repr=False)


def choose_blas(
    mode: Literal["auto", "bundled"] = "auto",
    environ: Mapping[str, str] | None = None,
    platform_name: str = sys.platform,
    machine: str | None = None,
    exists: Callable[[str], bool] = os.path.exists,
) -> BlasChoice:
    """The BLAS for the demo's session processes.

    Args:
        mode: ``"auto"`` preloads Debian's OpenBLAS when it is installed;
            ``"bundled"`` runs MLX's own BLAS (any BLAS in ``LD_PRELOAD`` is dropped).
        environ: the parent's environment (``os.environ`` when None).
        platform_name: ``sys.platform``.
        machine: ``platform.machine()`` when None.
        exists: how to test for the library file (tests pass a fake).
    """
    env = dict(os.environ if environ is None else environ)
    if platform_name == "darwin":
        return BlasChoice(True, "Accelerate / Metal (macOS)", env)
    preloaded = blas_info(maps="", environ=env, platform_name=platform_name)["preloaded"]
    if mode == "bundled":
        kept = [p for p in env.get("LD_PRELOAD", "").split(":") if p and p not in preloaded]
        env["LD_PRELOAD"] = ":".join(kept)
        if not kept:
            del env["LD_PRELOAD"]
        return BlasChoice(False, "MLX's bundled reference BLAS (--blas bundled)", env)
    if preloaded:
        return BlasChoice(True, f"already preloaded: LD_PRELOAD={':'.join(preloaded)}", env)
    library = OPENBLAS.get(machine or platform.machine())
    if library is not None and exists(library):
        env["LD_PRELOAD"] = ":".join(p for p in (library, env.get("LD_PRELOAD")) if p)
        return BlasChoice(True, f"OpenBLAS preloaded for the sessions (LD_PRELOAD={library})", env)
    return BlasChoice(False, f"MLX's bundled reference BLAS ({_INSTALL_HINT})", env)
