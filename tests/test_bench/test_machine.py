"""Machine description: BLAS detection from the process's mapped libraries, versions, git."""

from __future__ import annotations

import subprocess
from importlib import metadata

import pytest

from kvstore.bench.machine import (
    blas_info,
    describe,
    git_revision,
    machine_info,
    memory_touch,
    package_versions,
)

BUNDLED = "/v/site-packages/mlx_cpu.libs/libblas-bd8a282c.so.3.10.0"
NUMPY = "/v/site-packages/numpy.libs/libscipy_openblas64_-32a4b2a6.so"
PRELOAD = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3"
OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblasp-r0.3.21.so"


def maps(*paths: str) -> str:
    return (
        "".join(
            f"7f00000{i}000-7f00000{i}fff r-xp 00000000 fe:01 {i} {p}\n"
            for i, p in enumerate(paths)
        )
        + "7ffd0000-7ffd1000 rw-p 00000000 00:00 0 [stack]\n"
    )


def test_bundled_reference_blas_is_named_slow():
    info = blas_info(maps(BUNDLED, NUMPY, "/lib/libc.so.6"), {}, "linux")
    assert info["mlx"].startswith("reference BLAS bundled with mlx[cpu]")
    assert "BLAS caveat" in info["mlx"]
    assert info["loaded"] == sorted([BUNDLED, NUMPY]) and info["preloaded"] == []


def test_preloaded_openblas_is_what_mlx_calls():
    info = blas_info(maps(PRELOAD, OPENBLAS, BUNDLED, NUMPY), {"LD_PRELOAD": PRELOAD}, "linux")
    assert info["mlx"] == f"OpenBLAS via LD_PRELOAD={PRELOAD}"
    assert info["preloaded"] == [PRELOAD]


def test_a_preload_that_is_not_mapped_does_not_count():
    info = blas_info(maps(BUNDLED), {"LD_PRELOAD": PRELOAD}, "linux")
    assert info["mlx"].startswith("reference BLAS")


def test_macos_is_accelerate():
    assert blas_info("", {}, "darwin")["mlx"] == "Accelerate (macOS)"


def test_this_process_reports_the_blas_it_has_mapped():
    import mlx.core  # noqa: F401 - maps MLX's BLAS

    info = blas_info()
    assert info["loaded"], "mlx maps some BLAS on Linux"
    assert not info["mlx"].startswith("unknown")


def test_machine_info_and_versions_describe_this_process():
    info = machine_info()
    assert info["logical_cpus"] >= 1 and info["usable_cpus"] >= 1
    assert info["memory_bytes"] > 0
    assert info["cpu"] and info["os"] and info["python"].startswith("CPython 3.")
    versions = package_versions()
    assert versions["mlx"] == metadata.version("mlx")
    assert versions["mlx-lm"] == metadata.version("mlx-lm")
    assert versions["numpy"] == metadata.version("numpy")
    assert versions["lmdb"] == metadata.version("lmdb")
    described = describe()
    assert set(described) == {"machine", "versions", "git"}
    touch = described["machine"]["memory_touch"]
    assert set(touch) == {"first", "reused"} and min(touch.values()) > 0


def test_memory_touch_reports_both_rates_or_none():
    assert memory_touch(1 << 20)["first"] > 0
    assert memory_touch(0) is None  # nothing mapped: no figure, not an error


def _git(cwd, *args):
    return subprocess.run(
        ["git", *args], cwd=cwd, check=True, capture_output=True, text=True
    ).stdout.strip()


def test_git_revision_of_a_checkout_and_of_no_checkout(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    try:
        _git(repo, "init", "-q", "-b", "main")
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("git is not installed")
    (repo / "f").write_text("1")
    _git(repo, "add", "f")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    assert git_revision(repo) == {
        "revision": _git(repo, "rev-parse", "HEAD"),
        "branch": "main",
        "dirty": False,
    }
    (repo / "f").write_text("2")
    assert git_revision(repo)["dirty"] is True
    plain = tmp_path / "plain"
    plain.mkdir()
    assert git_revision(plain) is None
