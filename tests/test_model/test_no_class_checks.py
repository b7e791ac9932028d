"""The model routes on capability predicates only: no isinstance/hasattr in kvstore/model."""

import ast
from pathlib import Path

import kvstore.model

PACKAGE = Path(kvstore.model.__file__).parent
FORBIDDEN = {"isinstance", "hasattr"}


def forbidden_calls(source: str) -> list[tuple[int, str]]:
    return [
        (node.lineno, node.func.id)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in FORBIDDEN
    ]


def test_no_isinstance_or_hasattr_in_the_model_package():
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) >= 8  # the whole package is parsed, not an empty glob
    found = {
        str(f.relative_to(PACKAGE)): calls
        for f in files
        if (calls := forbidden_calls(f.read_text()))
    }
    assert found == {}, f"class checks in kvstore/model (use kvstore.abc.cache predicates): {found}"


def test_the_check_sees_a_call():
    assert forbidden_calls("if hasattr(cache, 'bits'):\n    isinstance(cache, int)\n") == [
        (1, "hasattr"),
        (2, "isinstance"),
    ]
