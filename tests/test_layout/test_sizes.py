"""The block engine's class stays small enough to read (issue 14: it was 738 lines,
with its budget eviction written twice); work it grows goes into store/blocks/ modules."""

from __future__ import annotations

import ast
from pathlib import Path

import kvstore.store.blocks.prefix as prefix

LIMIT = 500


def _class_lines(path: Path, name: str) -> int:
    tree = ast.parse(path.read_text())
    (node,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name]
    assert node.end_lineno is not None
    return node.end_lineno - node.lineno + 1


def test_block_prefix_store_is_under_500_lines():
    lines = _class_lines(Path(prefix.__file__), "BlockPrefixStore")
    assert lines < LIMIT, (
        f"BlockPrefixStore is {lines} lines (limit {LIMIT}): move a job it does into a "
        f"module of kvstore/store/blocks/ (matching, saving, stats, checks, eviction...)."
    )


def test_the_count_is_of_the_class(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("x = 1\n\nclass BlockPrefixStore:\n    a = 1\n    b = 2\n\ny = 2\n")
    assert _class_lines(src, "BlockPrefixStore") == 3
