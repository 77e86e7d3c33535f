"""The test tree keeps its layout (tests/README.md): test modules import shared code from
``tests.helpers`` or a folder's ``conftest.py``, never from another test module, and each
test module sits in a folder the README names."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
README = (TESTS / "README.md").read_text()


def our_python_files() -> list[Path]:
    """Every Python file of the suite; the example plugin packages under tests/plugins/ are
    data (each a distribution with its own tests), not part of it."""
    return sorted(
        path
        for path in TESTS.rglob("*.py")
        if "__pycache__" not in path.parts and path.relative_to(TESTS).parts[0] != "plugins"
    )


def imported_modules(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            found.append((node.lineno, base))
            # ``from tests.server import test_x`` names the module in the import list
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def names_a_test_module(name: str) -> bool:
    last = name.rsplit(".", 1)[-1]
    return last.startswith("test_") or last == "conftest"


def test_no_test_module_imports_another() -> None:
    offenders = [
        f"{path.relative_to(ROOT)}:{line}: imports {name}"
        for path in our_python_files()
        for line, name in imported_modules(path)
        if names_a_test_module(name)
    ]
    assert not offenders, (
        "shared test code belongs in tests/helpers/ (or a folder's conftest.py):\n"
        + "\n".join(offenders)
    )


def test_every_test_module_sits_in_a_folder_the_readme_names() -> None:
    folders = set(re.findall(r"^\| `(\w+)/` \|", README, re.MULTILINE))
    misplaced = [
        str(path.relative_to(ROOT))
        for path in our_python_files()
        if path.name.startswith("test_") and path.relative_to(TESTS).parts[0] not in folders
    ]
    assert not misplaced, f"test modules outside the folders tests/README.md names: {misplaced}"
    # and the README names no folder that is gone
    gone = sorted(f for f in folders if not (TESTS / f).is_dir())
    assert not gone, f"tests/README.md names folders that do not exist: {gone}"


def test_every_folder_is_a_package() -> None:
    """Packages give every module a unique name (tests.server.test_x), so two folders may
    hold modules of the same file name."""
    missing = sorted(
        str(folder.relative_to(ROOT))
        for folder in [TESTS, *TESTS.iterdir()]
        if folder.is_dir()
        and folder.name not in ("plugins", "scripts", "__pycache__")
        and any(folder.glob("*.py"))
        and not (folder / "__init__.py").exists()
    )
    assert not missing, f"folders without __init__.py: {missing}"
