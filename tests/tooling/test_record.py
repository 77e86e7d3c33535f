"""The repository states the present: every module in the layout, no development history
or temporary paths in the docs, no dead code."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ARCHITECTURE = (ROOT / "docs" / "architecture.md").read_text()
PACKAGES = ["core", *sorted(p.name for p in ROOT.glob("builtin_*") if p.is_dir())]


def modules() -> list[str]:
    """Every source module as the layout names it: ``engine/core.py`` under core/,
    ``builtin_cpu/enginecore_cpu/attention.py`` for a built-in package."""
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*")):
            if path.suffix not in (".py", ".c") or path.name == "__init__.py":
                continue
            if "__pycache__" in path.parts:
                continue
            rel = path.relative_to(ROOT / "core" / "enginecore" if package == "core" else ROOT)
            found.append(str(rel))
    return found


def test_the_layout_names_every_module():
    named = set(re.findall(r"`([\w/]+\.(?:py|c))`", ARCHITECTURE))
    # `builtin_*/plugin.py` stands for every built-in package's registrations
    missing = [
        m
        for m in modules()
        if m not in named and not (m.startswith("builtin_") and m.endswith("/plugin.py"))
    ]
    # layers/ and testing/ are one row each, naming their files without the folder
    missing = [
        m
        for m in missing
        if not (
            m.split("/")[0] in ("layers", "testing") and f"`{m.split('/')[-1]}`" in ARCHITECTURE
        )
    ]
    assert not missing, f"docs/architecture.md's layout does not name: {missing}"


HISTORY = re.compile(
    r"\bsession\b|/tmp/|\b(first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth"
    r"|eleventh|twelfth|thirteenth|fourteenth) (session|round)\b|\bwent from\b",
    re.IGNORECASE,
)


def doc_files() -> list[Path]:
    return [
        ROOT / "README.md",
        ROOT / "CONTRIBUTING.md",
        *sorted((ROOT / "docs").glob("*.md")),
        *sorted((ROOT / "benchmarks").rglob("*.md")),
    ]


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_docs_carry_no_history_or_temporary_paths(path):
    hits = [
        f"{n}: {line.strip()}"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if HISTORY.search(line) and "scope" not in line and "| session |" not in line
    ]
    assert not hits, f"{path.relative_to(ROOT)}: " + "\n".join(hits)


def test_no_dead_code():
    """vulture, configured in pyproject.toml, finds nothing unused or unreachable."""
    done = subprocess.run(
        [sys.executable, "-m", "vulture"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
