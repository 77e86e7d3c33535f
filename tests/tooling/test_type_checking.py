"""`make lint` type-checks every package strictly: the core and each built-in distribution
are in mypy's `packages`, every source root is on its path, and no override relaxes a
whole package (only named Triton kernel modules, whose arguments Triton types at launch)."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SOURCE_ROOTS = ["core", *sorted(p.name for p in ROOT.glob("builtin_*") if p.is_dir())]
# Settings that would exempt code from the strict check.
RELAXING = ("follow_imports", "ignore_errors", "strict", "check_untyped_defs")


def _mypy() -> dict[str, Any]:
    settings: dict[str, Any] = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]
    return settings


def _packages_of(root: str) -> list[str]:
    return sorted(p.parent.name for p in (ROOT / root).glob("*/__init__.py"))


def test_every_source_root_is_on_mypys_path():
    assert set(_mypy()["mypy_path"].split(":")) == set(SOURCE_ROOTS)


def test_every_package_is_checked():
    checked = set(_mypy()["packages"])
    missing = [pkg for root in SOURCE_ROOTS for pkg in _packages_of(root) if pkg not in checked]
    assert not missing, f"not type-checked by make lint: {missing}"


def test_no_override_relaxes_a_package():
    settings = _mypy()
    assert settings["strict"] is True
    for override in settings.get("overrides", []):
        modules = override["module"]
        modules = [modules] if isinstance(modules, str) else modules
        relaxed = [key for key in RELAXING if key in override]
        assert not relaxed, f"{modules} relaxed by {relaxed}"
        if "disallow_untyped_defs" in override:
            # Only named kernel modules, never a package's wildcard.
            assert not any(m.endswith("*") for m in modules), modules


def test_a_type_ignore_names_its_error():
    assert "ignore-without-code" in _mypy()["enable_error_code"]
