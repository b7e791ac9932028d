"""The changelog and the version agree, and every fragment waiting in ``changelog.d/``
builds (``changelog.d/README.md``; httpx's ``sync-version`` check, attrs' fragments)."""

from __future__ import annotations

import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10: the dev extra's tomli
    import tomli as tomllib

import kvstore

ROOT = Path(__file__).resolve().parent.parent
FRAGMENTS = ROOT / "changelog.d"
#: ``<issue>.<type>.md``, ``<issue>.<type>.<n>.md`` or ``+<name>.<type>.md``.
NAME = re.compile(r"^(?:\d+|\+[a-z0-9-]+)\.(?P<type>[a-z]+)(?:\.\d+)?\.md$")
RELEASE = re.compile(r"^## (\d+)\.(\d+)\.(\d+) ", re.M)


def _types() -> set[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["towncrier"]
    return {kind["directory"] for kind in config["type"]}


def _fragments() -> list[Path]:
    return sorted(p for p in FRAGMENTS.iterdir() if p.name != "README.md")


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


def test_every_fragment_is_named_for_a_type_and_says_something() -> None:
    types = _types()
    for path in _fragments():
        found = NAME.match(path.name)
        assert found, f"{path.name}: name it <issue>.<type>.md or +<name>.<type>.md"
        assert found["type"] in types, f"{path.name}: {found['type']!r} is not one of {types}"
        assert path.read_text().strip(), f"{path.name} is empty"


def test_the_version_has_one_home_and_the_changelog_agrees() -> None:
    # pyproject.toml reads the version from kvstore/__init__.py, never states its own.
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "version" not in project and "version" in project["dynamic"]
    assert metadata.version("mlx-kvstore") == kvstore.__version__
    text = (ROOT / "CHANGELOG.md").read_text()
    assert "<!-- towncrier release notes start -->\n" in text
    releases = [tuple(map(int, m)) for m in RELEASE.findall(text)]
    assert releases == sorted(releases, reverse=True), "CHANGELOG.md: newest release first"
    version = _version(kvstore.__version__)
    if releases:
        assert version >= releases[0], (
            f"kvstore.__version__ {kvstore.__version__} is behind CHANGELOG.md's newest "
            f"release {'.'.join(map(str, releases[0]))}"
        )
    if not _fragments():  # nothing waits: the version is the release the changelog ends at
        assert releases and version == releases[0], (
            f"kvstore.__version__ {kvstore.__version__} has no section in CHANGELOG.md"
        )


def test_the_next_releases_notes_build_from_every_fragment() -> None:
    pytest.importorskip("towncrier", reason="towncrier comes with the dev extra")
    draft = subprocess.run(
        [sys.executable, "-m", "towncrier", "build", "--draft", "--version", kvstore.__version__],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert draft.returncode == 0, draft.stderr
    notes = " ".join(draft.stdout.split())
    assert f"## {kvstore.__version__} " in draft.stdout
    for path in _fragments():
        first = " ".join(path.read_text().split())[:60]
        assert first in notes, f"{path.name} is missing from the draft"
