"""``enginecore plugin new NAME --kind KIND``: write a complete plugin package.

The package installs with ``pip install -e .`` and passes its own tests unchanged: a
pyproject with the entry point, the plugin module, the component, a test that runs the
conformance kit against it, and a README.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path
from string import Template

from enginecore.component_kinds import COMPONENT_KINDS
from enginecore.errors import EngineCoreError
from enginecore.starter.templates import INIT, KINDS, PLUGIN, PYPROJECT, README, Kind

# The plugin-API range a new plugin declares: this major version.
_NAME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9._-]*[A-Za-z0-9]$")
_REGISTRY_KIND = {kind.hook: kind.name for kind in COMPONENT_KINDS}
_CONFIG_EXPR = {
    kind.name: kind.config_expr or f"config.{kind.config_key}" for kind in COMPONENT_KINDS
}
_PARSER_KINDS = {
    kind.name
    for kind in COMPONENT_KINDS
    if kind.config_key and kind.config_key.startswith("server.")
}


class StarterError(EngineCoreError):
    """The plugin cannot be created as asked; the message says what to change."""


@dataclass(frozen=True)
class PluginNames:
    dist: str  # enginecore-fair
    package: str  # enginecore_fair
    entry_point: str  # fair
    component: str  # fair (the name a config selects)
    cls: str  # FairPolicy


def api_range() -> str:
    from enginecore.version import PLUGIN_API_VERSION

    major = int(PLUGIN_API_VERSION.split(".")[0])
    return f">={major}.0,<{major + 1}"


def derive_names(name: str, kind: Kind) -> PluginNames:
    if not _NAME_RE.match(name):
        raise StarterError(
            f"plugin name {name!r} is not a valid distribution name: use letters, digits, "
            "'-', '_' or '.', starting with a letter (for example 'enginecore-fair')"
        )
    dist = name.lower()
    package = re.sub(r"[-.]+", "_", dist)
    short = re.sub(r"^enginecore[-_.]", "", dist) or dist
    entry_point = re.sub(r"[-.]+", "_", short)
    camel = "".join(part.capitalize() for part in re.split(r"[-_.]+", short) if part)
    cls = camel if camel.endswith(kind.class_suffix) else camel + kind.class_suffix
    component = cls if kind.hook == "register_models" else short
    return PluginNames(dist, package, entry_point, component, cls)


def render(kind_name: str, names: PluginNames) -> dict[str, str]:
    """Relative path -> file text for the whole package."""
    kind = KINDS[kind_name]
    registry_kind = _REGISTRY_KIND[kind.hook]
    select = Template(kind.select_toml).substitute(component=names.component)
    if registry_kind == "stat_logger":
        config_value = f'["logging", "{names.component}"]'
    else:
        config_value = f'"{names.component}"'
    if registry_kind == "model":
        use_section = (
            f"A checkpoint selects it: its `config.json` names the architecture, "
            f'`"architectures": ["{names.component}"]`, and the torch model runner builds '
            f"`{names.cls}` for it:\n\n```bash\nenginecore serve CHECKPOINT_DIR\n```"
        )
    elif registry_kind in _PARSER_KINDS:
        flags = (
            f"--enable-auto-tool-choice --tool-call-parser {names.component}"
            if registry_kind == "tool_parser"
            else f"--reasoning-parser {names.component}"
        )
        use_section = (
            "The OpenAI-compatible server uses it:\n\n```bash\n"
            f"enginecore serve MODEL {flags}\n```\n\nor in a config file:\n\n```toml\n"
            f"# engine.toml\n{select.rstrip()}\n```"
        )
    else:
        use_section = (
            "Select it in a config file:\n\n```toml\n# engine.toml\n"
            f"{select.rstrip()}\n```\n\n```bash\nenginecore serve MODEL --config engine.toml\n"
            f"```\n\nor `LLM(model=..., {kind.config_key}={config_value})`."
        )
    values = {
        "dist": names.dist,
        "package": names.package,
        "entry_point": names.entry_point,
        "component": names.component,
        "cls": names.cls,
        "api": api_range(),
        "hook": kind.hook,
        "module": kind.module,
        "summary": f"{names.cls}: {kind.summary}",
        "registry_kind": registry_kind,
        "select_toml": select.rstrip("\n"),
        "select_toml_literal": repr(select),
        "config_expr": _CONFIG_EXPR[registry_kind],
        "config_key": kind.config_key,
        "config_value": config_value,
        "test_name": re.sub(r"\W", "_", names.component.lower()),
        "use_section": use_section,
    }

    def fill(text: str) -> str:
        return Template(text).substitute(values)

    src = f"src/{names.package}"
    files = {
        "pyproject.toml": fill(PYPROJECT),
        "README.md": fill(README),
        f"{src}/__init__.py": fill(INIT),
        f"{src}/plugin.py": fill(PLUGIN),
        f"{src}/{kind.module}.py": fill(kind.component),
        f"tests/test_{names.package}.py": fill(kind.test),
    }
    if kind.extra_tests:
        filename, _, source = kind.extra_tests.partition("\n---\n")
        files[f"tests/{filename}"] = fill(source)
    return files


def create_plugin(name: str, kind_name: str, directory: Path | None = None) -> Path:
    """Write the package into ``directory`` (default ``./NAME``); returns its path."""
    if kind_name not in KINDS:
        raise StarterError(f"unknown plugin kind {kind_name!r}; choose one of {', '.join(KINDS)}")
    names = derive_names(name, KINDS[kind_name])
    target = Path(directory) if directory is not None else Path.cwd() / names.dist
    if target.exists() and any(target.iterdir()):
        raise StarterError(f"{target} already exists and is not empty; pick another --dir")
    for relative, text in render(kind_name, names).items():
        path = target / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return target


def cmd_plugin_new(args: argparse.Namespace) -> int:
    target = create_plugin(args.name, args.kind, Path(args.dir) if args.dir else None)
    names = derive_names(args.name, KINDS[args.kind])
    print(f"created {args.kind} plugin {names.dist!r} in {target}")
    print("next:")
    print(f"  cd {target}")
    print("  pip install -e '.[test]'")
    print("  python -m pytest")
    print("  enginecore plugins --check")
    return 0


def add_plugin_new_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("plugin", help="plugin author tools (plugin new)")
    plugin_sub = p.add_subparsers(dest="plugin_command", required=True)
    new = plugin_sub.add_parser(
        "new",
        help="write a complete plugin package (entry point, module, tests, README)",
        description="Write a plugin package that installs with pip and passes its tests.",
    )
    new.add_argument("name", help="distribution name, e.g. enginecore-fair")
    new.add_argument(
        "--kind",
        required=True,
        choices=sorted(KINDS),
        type=lambda kind: kind.replace("_", "-"),  # tool_parser as well as tool-parser
        help="what it provides",
    )
    new.add_argument("--dir", help="where to write it (default: ./NAME)")
    new.set_defaults(func=cmd_plugin_new)
