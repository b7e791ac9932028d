"""Layers only look down, and no module imports itself around a circle (issue 14).

Bottom up: errors -> signature -> the ``kvstore`` package -> abc (contracts only)
-> turboquant's math -> caches -> codecs -> store (keys, settings, engines, the
block engine, live caches in and out) beside the model (store-free) -> the bridge
(model <-> store) -> maintenance tools -> the mlx-lm integration -> cli / demo /
bench / serve / testing.

Every ``import`` and ``from ... import`` in every module counts, at module level
or inside a function. ``from package import name`` is an edge to
``package.name`` when that is a module, else to ``package``; a package's parents
are not edges (importing ``kvstore.store.keys`` runs ``kvstore/store/__init__``,
which would otherwise make every package a circle with its children).

Old import paths the README has used are kept, one way up each, listed in
:data:`COMPAT` with why; nothing inside kvstore may import through them.

Imports by name (``importlib.import_module("kvstore....")`` with a literal) are
read too. One goes up on purpose, :data:`SANCTIONED_STRING_IMPORTS`:
:mod:`kvstore.family` (beside the signature grammar, at the bottom) imports
``kvstore.codecs`` by name on its first miss, because importing that package
is what registers the built-in families (one ``register_codec`` line each)
and the registry must not import what it registers. Any other upward import
by name fails here.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import kvstore

ROOT = Path(kvstore.__file__).parent

#: Module prefix -> (rank, group). A module may import a lower rank, or its own
#: group; the longest matching prefix decides.
LAYERS: dict[str, tuple[int, str]] = {
    "kvstore.errors": (0, "errors"),
    "kvstore.signature": (1, "signature"),
    "kvstore.family": (1, "signature"),
    "kvstore.layout": (1, "signature"),
    "kvstore": (2, "root"),
    "kvstore.abc": (3, "abc"),
    "kvstore.turboquant": (4, "turboquant"),  # the quantizer's math, under its cache
    "kvstore.caches": (5, "caches"),
    "kvstore.codecs": (6, "codecs"),
    "kvstore.store": (7, "store"),
    "kvstore.model": (7, "model"),
    "kvstore.bridge": (8, "bridge"),
    "kvstore.store.maintenance": (9, "maintenance"),
    "kvstore.mlx_lm": (10, "mlx_lm"),
    "kvstore.cli": (11, "top"),
    "kvstore.demo": (11, "top"),
    "kvstore.bench": (11, "top"),
    "kvstore.serve": (11, "top"),
    "kvstore.testing": (11, "top"),
}

#: Compat re-exports: (importer, imported) -> why it may go up. Call-time only.
COMPAT: dict[tuple[str, str], str] = {
    ("kvstore.store", "kvstore.bridge"): (
        "kvstore.store.namespace_for_model/model_fingerprint/namespace_for (README since "
        "0.1), resolved by the package's __getattr__ on first use"
    ),
    ("kvstore.store.migrate", "kvstore.store.maintenance.migrate"): (
        "kvstore.store.migrate.migrate (README since 0.1)"
    ),
    ("kvstore.store.cache_files", "kvstore.store.maintenance.cache_files"): (
        "kvstore.store.cache_files.import_cache_file/export_cache_file (README since 0.1)"
    ),
}
COMPAT_MODULES = {"kvstore.store.migrate", "kvstore.store.cache_files"}

#: Upward imports by name: (importer, imported) -> why. See the module docstring.
SANCTIONED_STRING_IMPORTS: dict[tuple[str, str], str] = {
    ("kvstore.family", "kvstore.codecs"): (
        "the registry bootstraps the built-in families on its first miss by importing the "
        "package whose registration lines register them"
    ),
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def is_module(name: str) -> bool:
    return name in MODULES


def imports_of(name: str, source: str | None = None) -> list[tuple[str, int]]:
    """``(imported kvstore module, line)`` for every import statement in ``name``."""
    path = MODULES.get(name)
    tree = ast.parse(source if source is not None else path.read_text())  # type: ignore[union-attr]
    package = name if path is not None and path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names if a.name.startswith("kvstore")]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            if not base.startswith("kvstore"):
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.append((sub if is_module(sub) else base, node.lineno))
    return found


def layer_of(name: str) -> tuple[int, str]:
    best = max((p for p in LAYERS if name == p or name.startswith(p + ".")), key=len)
    return LAYERS[best]


def upward_imports(name: str, source: str | None = None) -> list[str]:
    rank, group = layer_of(name)
    bad = []
    for target, line in imports_of(name, source):
        if (name, target) in COMPAT or name in COMPAT_MODULES:
            continue
        t_rank, t_group = layer_of(target)
        if t_group != group and t_rank >= rank:
            bad.append(f"{name}:{line} imports {target} ({t_group}, layer {t_rank} >= {rank})")
    return bad


def test_every_module_has_a_layer():
    assert all(layer_of(name) for name in MODULES)


def test_layers_only_look_down():
    bad = [problem for name in MODULES for problem in upward_imports(name)]
    assert bad == []


@pytest.mark.parametrize(
    "module, planted",
    [
        ("kvstore.abc.store", "from kvstore.store.kv.save import save_caches"),
        ("kvstore.model.generate", "from kvstore.bridge.session import StoreSession"),
        ("kvstore.codecs.record", "import kvstore.store.blocks.prefix"),
        ("kvstore.store.blocks.prefix", "from kvstore.store.maintenance import inventory"),
        ("kvstore.signature", "from kvstore.abc.cache import signature_of"),
    ],
)
def test_a_planted_upward_import_is_caught(module, planted):
    def inside_a_function(line: str) -> str:  # call-time imports count too
        return f"def f():\n    {line}\n"

    source = MODULES[module].read_text()
    assert upward_imports(module, source) == []
    assert upward_imports(module, source + "\n" + planted + "\n")
    assert upward_imports(module, source + "\n" + inside_a_function(planted))


def string_imports(name: str, source: str | None = None) -> list[tuple[str, int]]:
    """``(kvstore module, line)`` for every ``import_module("kvstore....")`` with a literal."""
    tree = ast.parse(source if source is not None else MODULES[name].read_text())
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not node.args:
            continue
        func = node.func
        called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        arg = node.args[0]
        if (
            called == "import_module"
            and isinstance(arg, ast.Constant)
            and isinstance(arg.value, str)
            and arg.value.startswith("kvstore")
        ):
            found.append((arg.value, node.lineno))
    return found


def upward_string_imports(name: str, source: str | None = None) -> set[tuple[str, str]]:
    rank, group = layer_of(name)
    return {
        (name, target)
        for target, _ in string_imports(name, source)
        if layer_of(target)[1] != group and layer_of(target)[0] >= rank
    }


def test_the_one_upward_import_by_name_is_the_registry_bootstrap():
    found = set().union(*(upward_string_imports(name) for name in MODULES))
    assert found == set(SANCTIONED_STRING_IMPORTS)
    planted = 'import importlib\nimportlib.import_module("kvstore.store.keys")\n'
    source = MODULES["kvstore.caches.base"].read_text() + planted
    assert upward_string_imports("kvstore.caches.base", source)


def test_nothing_inside_kvstore_imports_through_a_compat_path():
    users = [
        f"{name}:{line}"
        for name in MODULES
        for target, line in imports_of(name)
        if target in COMPAT_MODULES and name not in COMPAT_MODULES
    ]
    assert users == []


def import_graph() -> dict[str, set[str]]:
    return {
        name: {t for t, _ in imports_of(name) if t != name and (name, t) not in COMPAT}
        for name in MODULES
    }


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circles():
    assert circles(import_graph()) == []


def test_the_circle_finder_finds_a_planted_circle():
    graph = import_graph()
    graph["kvstore.abc.store"] = graph["kvstore.abc.store"] | {"kvstore.store.kv.save"}
    assert any("kvstore.abc.store" in c for c in circles(graph))
