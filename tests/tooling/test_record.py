"""The repository states the present: the layout names every package and only paths that
exist, the docs carry no development history or temporary paths, no dead code."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ARCHITECTURE = (ROOT / "docs" / "architecture.md").read_text()
PACKAGES = ["core", *sorted(p.name for p in ROOT.glob("builtin_*") if p.is_dir())]


def cited_paths() -> set[str]:
    """Every path docs/architecture.md cites in backticks: a folder (``engine/``) or a file
    (``engine/core.py``, ``enginecore_models/model_runner.py``)."""
    return set(re.findall(r"`([\w./]+/|[\w./]+\.(?:py|c|h|md|toml|json))`", ARCHITECTURE))


# Files of a checkpoint, not of this repository.
CHECKPOINT_FILES = {"config.json"}


def resolves(path: str) -> bool:
    """A cited path names a file or folder from the repository root, from
    ``core/enginecore/`` or from a built-in's folder (``enginecore_cpu/attention.py``)."""
    if path in CHECKPOINT_FILES:
        return True
    bases = [ROOT, ROOT / "core" / "enginecore", *(ROOT / p for p in PACKAGES[1:])]
    return any((base / path).exists() for base in bases)


def packages() -> list[str]:
    """Every source package as the doc names it: ``engine/`` under core/, ``builtin_cpu/``
    for a built-in, ``enginecore_models/models/`` for a package inside one."""
    found = []
    for package in PACKAGES:
        for init in sorted((ROOT / package).rglob("__init__.py")):
            folder = init.parent
            if folder == ROOT / "core" / "enginecore":
                continue
            if package == "core":
                found.append(f"{folder.relative_to(ROOT / 'core' / 'enginecore')}/")
            elif folder.parent == ROOT / package:
                found.append(f"{package}/")
            else:
                found.append(f"{folder.relative_to(ROOT / package)}/")
    return found


def test_the_layout_names_every_package():
    cited = cited_paths()
    missing = [p for p in packages() if not any(c.startswith(p) for c in cited)]
    assert not missing, f"docs/architecture.md's layout does not name the packages: {missing}"


def test_every_path_the_layout_cites_exists():
    stale = sorted(p for p in cited_paths() if not resolves(p))
    assert not stale, f"docs/architecture.md cites paths that do not exist: {stale}"


HISTORY = re.compile(
    r"\bsession\b|/tmp/|\b(first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth"
    r"|eleventh|twelfth|thirteenth|fourteenth) (session|round)\b|\bwent from\b",
    re.IGNORECASE,
)


def doc_files() -> list[Path]:
    return [
        ROOT / "README.md",
        ROOT / "CONTRIBUTING.md",
        ROOT / "tests" / "README.md",
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
