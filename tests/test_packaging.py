"""pyproject.toml ships every package of the source tree (a plain, non-editable install)."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_source_package_is_listed_and_every_listed_one_exists():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {name: ROOT / path for name, path in setuptools["package-dir"].items()}
    found = set()
    for name, folder in folders.items():
        for init in folder.rglob("__init__.py"):
            relative = init.parent.relative_to(folder).parts
            found.add(".".join((name, *relative)))
    assert set(setuptools["packages"]) == found


def test_every_c_source_ships_as_package_data():
    """The CPU kernels are compiled from their C sources on first use, so a plain install
    needs every ``.c`` and ``.h`` file a package holds."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    package_data = setuptools.get("package-data", {})
    missing = []
    for name, path in setuptools["package-dir"].items():
        folder = ROOT / path
        for source in [*folder.rglob("*.c"), *folder.rglob("*.h")]:
            package = ".".join((name, *source.parent.relative_to(folder).parts))
            patterns = package_data.get(package, [])
            if not any(source.match(pattern) for pattern in patterns):
                missing.append(str(source.relative_to(ROOT)))
    assert not missing, f"not in [tool.setuptools.package-data]: {missing}"
