"""The example packages of ``plugins/`` pip-installed (editable) into the running venv, once."""

from __future__ import annotations

import importlib
import json
import sys
import tomllib
from pathlib import Path

import importlib_metadata


def is_current(dist_name: str, path: Path) -> bool:
    """Installed editable from ``path`` with the version and entry points its pyproject has."""
    try:
        dist = importlib_metadata.distribution(dist_name)
    except importlib_metadata.PackageNotFoundError:
        return False
    direct_url = json.loads(dist.read_text("direct_url.json") or "{}")
    project = tomllib.loads((path / "pyproject.toml").read_text())["project"]
    declared = project["entry-points"]["enginecore"]
    installed = {ep.name: ep.value for ep in dist.entry_points.select(group="enginecore")}
    return (
        direct_url.get("url") == path.as_uri()
        and direct_url.get("dir_info", {}).get("editable", False)
        and dist.version == project["version"]
        and installed == declared
    )


def add_editable_paths(dist_name: str) -> None:
    """Apply the package's ``.pth`` file to this interpreter, as ``site`` does at start-up."""
    dist = importlib_metadata.distribution(dist_name)
    for file in dist.files or []:
        if file.name.endswith(".pth"):
            for line in Path(file.locate()).read_text().splitlines():
                if line and not line.startswith(("#", "import")) and line not in sys.path:
                    sys.path.append(line)
    importlib.invalidate_caches()
