"""Each distribution's pyproject.toml ships every package of its source root (a plain,
non-editable install): `enginecore` from core/, each built-in from its builtin_*/ folder."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from setuptools import find_packages

ROOT = Path(__file__).resolve().parents[2]
# (source root, the folder holding its pyproject.toml)
DISTRIBUTIONS = [
    (ROOT / "core", ROOT),
    *((folder, folder) for folder in sorted(ROOT.glob("builtin_*")) if folder.is_dir()),
]


def _setuptools(project: Path) -> dict:
    return tomllib.loads((project / "pyproject.toml").read_text())["tool"]["setuptools"]


def _packages_on_disk(source_root: Path) -> set[str]:
    return {
        ".".join(init.parent.relative_to(source_root).parts)
        for init in source_root.rglob("__init__.py")
        if "__pycache__" not in init.parts
    }


@pytest.mark.parametrize("source_root, project", DISTRIBUTIONS, ids=lambda p: p.name)
def test_every_source_package_is_shipped(source_root, project):
    find = _setuptools(project)["packages"]["find"]
    where = project / find.get("where", ["."])[0]
    assert where == source_root
    shipped = set(find_packages(str(where), include=find.get("include", ("*",))))
    assert shipped == _packages_on_disk(source_root)


@pytest.mark.parametrize("source_root, project", DISTRIBUTIONS, ids=lambda p: p.name)
def test_every_c_source_ships_as_package_data(source_root, project):
    """The CPU kernels are compiled from their C sources on first use, so a plain install
    needs every ``.c`` and ``.h`` file a package holds."""
    package_data = _setuptools(project).get("package-data", {})
    missing = []
    for source in [*source_root.rglob("*.c"), *source_root.rglob("*.h")]:
        package = ".".join(source.parent.relative_to(source_root).parts)
        if not any(source.match(pattern) for pattern in package_data.get(package, [])):
            missing.append(str(source.relative_to(ROOT)))
    assert not missing, f"not in [tool.setuptools.package-data]: {missing}"
