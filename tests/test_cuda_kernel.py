"""kvstore's CUDA kernels (kvstore.cuda_kernel): each named by what it compiles, and on the
precompiled route compiled by NVRTC here, without a GPU, and kept on disk whole or not at all."""

from __future__ import annotations

import ast
import hashlib
import logging
import os
from pathlib import Path

import mlx.core as mx
import pytest

import kvstore
from kvstore import kernel_cache, nvrtc
from kvstore.cuda_kernel import PRECOMPILED, cuda_kernel, kernel_name, kernel_source
from kvstore.errors import StoreConfigError
from tools.bench.gpu import compile_check

ROOT = Path(kvstore.__file__).parent


def test_a_kernels_name_changes_with_anything_it_compiles():
    base = kernel_name("k", ["a"], ["out"], "out[0] = a[0];")
    assert base.startswith("k_") and len(base) == len("k_") + 16
    assert kernel_name("k", ["a"], ["out"], "out[0] = a[0];") == base
    assert kernel_name("k", ["a"], ["out"], "out[0] = a[0] + 1;") != base
    assert kernel_name("k", ["b"], ["out"], "out[0] = a[0];") != base
    assert kernel_name("k", ["a"], ["o"], "out[0] = a[0];") != base
    assert kernel_name("k", ["a"], ["out"], "out[0] = a[0];", header="#define X 1") != base


def test_no_module_builds_a_kernel_under_a_bare_name():
    # mx.fast.cuda_kernel(...) is called in kvstore/cuda_kernel.py and nowhere else.
    callers = []
    for path in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "cuda_kernel"
                and isinstance(node.func.value, ast.Attribute)
                and node.func.value.attr == "fast"
            ):
                callers.append(str(path.relative_to(ROOT)))
    assert callers == ["cuda_kernel.py"]


# --- the precompiled route (kvstore.cuda_kernel, kvstore.nvrtc, kvstore.kernel_cache) ---


COMPILER = nvrtc.compiler()
needs_nvrtc = pytest.mark.skipif(
    COMPILER is None,
    reason="no NVRTC here (the dev extra installs nvidia-cuda-nvrtc-cu12 on Linux x86_64)",
)
U8, U32, U64, F32 = mx.uint8, mx.uint32, mx.uint64, mx.float32


def test_the_whole_source_passes_shapes_and_ndims_after_the_outputs():
    src = kernel_source(
        "k",
        [("x", "__nv_bfloat16", 3, True), ("p", "uint64_t", None, False)],
        [("out", "float")],
        "out[0] = x_shape[2] + x_ndim;",
        header="#define H 1\n",
    )
    assert (
        'extern "C" __global__ void k(\n    const __nv_bfloat16* x,\n    const uint64_t* p,\n'
        "    float* out,\n    int x_shape_0,\n    int x_shape_1,\n    int x_shape_2,\n"
        "    int x_ndim) {\n    const int x_shape[3] = {x_shape_0, x_shape_1, x_shape_2};\n"
        "out[0] = x_shape[2] + x_ndim;\n}\n"
    ) in src
    assert src.startswith("#include <cuda_fp16.h>\n#include <cuda_bf16.h>\n")
    assert src.index("#define H 1") < src.index("__global__")
    plain = kernel_source("k", [("p", "uint64_t", None, False)], [("out", "uint8_t")], "")
    assert "#include" not in plain  # no half types: no CUDA header to parse


@needs_nvrtc
def test_every_kernel_compiles_on_the_precompiled_route():
    assert COMPILER is not None and 90 in COMPILER.architectures
    # Every kind of kernel, TurboQuant's at one width and head dim (compile_check.py
    # compiles every variant: ~500, a few minutes).
    for kernel, signature in compile_check.kernels(widths=(3,), dims=(128,)):
        symbol, source = kernel.source_for(signature)
        cubin = COMPILER.cubin(source, symbol, 90)
        assert cubin[:4] == b"\x7fELF", kernel.name  # a cubin is an ELF image
        assert symbol.encode() in cubin  # extern "C": MLX finds it by this name


@needs_nvrtc
def test_the_nvrtc_this_process_loaded_is_tried_first():
    # MLX's CUDA backend loads its NVRTC at import: that one, not another on the path.
    loaded = nvrtc._loaded()
    assert loaded and all("libnvrtc.so" in p.name for p in loaded)
    assert nvrtc._libraries()[: len(loaded)] == loaded


@needs_nvrtc
def test_a_source_that_does_not_compile_says_where():
    assert COMPILER is not None
    with pytest.raises(nvrtc.NvrtcError, match=r"(?s)broken does not compile for sm_90.*undefined"):
        COMPILER.cubin('extern "C" __global__ void broken(int* o) { o[0] = nope; }', "broken", 90)


def _cubin(tag: bytes) -> bytes:
    return b"\x7fELF" + hashlib.sha256(tag).digest() * 64


def test_a_compiled_kernel_is_kept_and_served_to_the_next_process(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSTORE_CACHE_DIR", str(tmp_path))
    compiles: list[bytes] = []

    def compile_(tag: bytes = b"a") -> bytes:
        compiles.append(tag)
        return _cubin(tag)

    key = kernel_cache.kernel_key("source", 90, (12, 9))
    assert kernel_cache.cached_cubin(key, compile_) == _cubin(b"a")
    assert kernel_cache.cached_cubin(key, compile_) == _cubin(b"a")
    assert compiles == [b"a"]  # the second read the file
    files = list((tmp_path / "cuda-kernels").iterdir())
    assert [f.name for f in files] == [f"{key[:40]}.cubin"]
    # Anything that made it is in the key: another source, GPU or compiler is another file.
    assert (
        len(
            {
                key,
                kernel_cache.kernel_key("source2", 90, (12, 9)),
                kernel_cache.kernel_key("source", 89, (12, 9)),
                kernel_cache.kernel_key("source", 90, (13, 0)),
            }
        )
        == 4
    )


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty", "foreign"])
def test_a_damaged_kernel_file_is_compiled_again_never_served(
    tmp_path, monkeypatch, caplog, damage
):
    monkeypatch.setenv("KVSTORE_CACHE_DIR", str(tmp_path))
    key = kernel_cache.kernel_key("source", 90, (12, 9))
    kernel_cache.cached_cubin(key, lambda: _cubin(b"a"))
    (path,) = (tmp_path / "cuda-kernels").iterdir()
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[-5] ^= 0x10
    elif damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "empty":
        data = bytearray()
    else:
        data = bytearray(_cubin(b"a"))  # a bare cubin: no magic, no digest
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="kvstore.cuda"):
        assert kernel_cache.cached_cubin(key, lambda: _cubin(b"b")) == _cubin(b"b")
    assert "is damaged; compiling it again" in caplog.text
    assert kernel_cache.cached_cubin(key, lambda: _cubin(b"c")) == _cubin(b"b")  # rewritten


def test_a_cache_that_cannot_be_written_only_costs_the_compile(tmp_path, monkeypatch):
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    monkeypatch.setenv("KVSTORE_CACHE_DIR", str(blocked))
    key = kernel_cache.kernel_key("source", 90, (12, 9))
    assert kernel_cache.cached_cubin(key, lambda: _cubin(b"a")) == _cubin(b"a")
    assert kernel_cache.cached_cubin(key, lambda: _cubin(b"b")) == _cubin(b"b")


def test_without_a_cuda_driver_a_kernel_is_left_to_mlx(monkeypatch, caplog):
    # NVRTC is here (the dev extra) but no driver answers: MLX's route, logged.
    def no_driver() -> int:
        raise OSError("libcuda.so.1: cannot open shared object file")

    monkeypatch.setattr(nvrtc, "device_architecture", no_driver)
    kernel = cuda_kernel("kvstore_test_probe", ["params"], ["out"], "out[0] = 1;")
    with caplog.at_level(logging.WARNING, logger="kvstore.cuda"):
        assert kernel._build(((U64,), (U8,), ())) is None
    if COMPILER is not None:
        assert "is left to MLX to compile (libcuda.so.1: cannot open" in caplog.text


@pytest.mark.skipif(mx.cuda.is_available(), reason="MLX has a CUDA backend here")
def test_without_cuda_a_kernels_call_raises_mlxs_error():
    kernel = cuda_kernel("kvstore_test_probe_call", ["params"], ["out"], "out[0] = 1;")
    with pytest.raises((RuntimeError, ValueError)):
        kernel(
            inputs=[mx.array([1], mx.uint64)],
            output_shapes=[(1,)],
            output_dtypes=[U8],
            grid=(1, 1, 1),
            threadgroup=(1, 1, 1),
        )


def test_the_switch_off_never_compiles(monkeypatch):
    monkeypatch.setenv(PRECOMPILED, "0")
    asked: list[int] = []
    monkeypatch.setattr(nvrtc, "device_architecture", lambda: asked.append(1) or 90)
    kernel = cuda_kernel("kvstore_test_probe_off", ["params"], ["out"], "out[0] = 1;")
    assert kernel._build(((U64,), (U8,), ())) is None
    assert asked == []


def test_the_kernels_folder_keeps_what_was_used_last_within_its_bound(tmp_path, monkeypatch):
    # Room for five files: a sixth written removes the one used least recently (a read
    # counts as a use), never the one just written.
    monkeypatch.setenv("KVSTORE_CACHE_DIR", str(tmp_path))
    size = len(kernel_cache._MAGIC) + kernel_cache._DIGEST + len(_cubin(b"0"))
    monkeypatch.setenv("KVSTORE_KERNEL_CACHE_MIB", repr(5.5 * size / 2**20))
    keys = [kernel_cache.kernel_key(f"source {i}", 90, (12, 9)) for i in range(6)]
    folder = tmp_path / "cuda-kernels"
    for i, key in enumerate(keys[:5]):
        kernel_cache.cached_cubin(key, lambda i=i: _cubin(b"%d" % i))
        os.utime(folder / f"{key[:40]}.cubin", (1000 + i, 1000 + i))  # written in this order
    compiles = []
    assert kernel_cache.cached_cubin(keys[0], lambda: compiles.append(0) or b"") == _cubin(b"0")
    assert not compiles  # the oldest file read: now the newest used
    kernel_cache.cached_cubin(keys[5], lambda: _cubin(b"5"))
    kept = sorted(f.name[:40] for f in folder.iterdir())
    assert kept == sorted(k[:40] for k in (keys[0], keys[2], keys[3], keys[4], keys[5]))
    # 0 keeps only the kernel just compiled.
    monkeypatch.setenv("KVSTORE_KERNEL_CACHE_MIB", "0")
    kernel_cache.cached_cubin(keys[1], lambda: _cubin(b"1"))
    assert [f.name[:40] for f in folder.iterdir()] == [keys[1][:40]]


def test_a_writers_abandoned_temporary_file_is_removed_a_live_one_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSTORE_CACHE_DIR", str(tmp_path))
    folder = tmp_path / "cuda-kernels"
    folder.mkdir()
    abandoned, live = folder / ".tmp-dead.cubin", folder / ".tmp-live.cubin"
    abandoned.write_bytes(b"half")
    live.write_bytes(b"half")
    os.utime(abandoned, (1000, 1000))
    kernel_cache.cached_cubin(kernel_cache.kernel_key("s", 90, (12, 9)), lambda: _cubin(b"a"))
    assert not abandoned.exists() and live.exists()


@pytest.mark.parametrize("value", ["lots", "-1", "nan"])
def test_a_bad_bound_on_the_kernels_folder_is_refused_before_any_compile(
    tmp_path, monkeypatch, value
):
    monkeypatch.setenv("KVSTORE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("KVSTORE_KERNEL_CACHE_MIB", value)
    compiles = []
    with pytest.raises(StoreConfigError, match="KVSTORE_KERNEL_CACHE_MIB"):
        kernel_cache.cached_cubin("k" * 64, lambda: compiles.append(1) or _cubin(b"a"))
    assert not compiles
