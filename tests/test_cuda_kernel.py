"""Every MLX CUDA kernel kvstore builds is named by what it compiles (kvstore.cuda_kernel):
MLX loads a compiled kernel by name from its on-disk cache without comparing sources."""

from __future__ import annotations

import ast
from pathlib import Path

import kvstore
from kvstore.cuda_kernel import kernel_name

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
