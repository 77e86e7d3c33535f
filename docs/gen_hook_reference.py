"""Writes docs/hooks.md, the hook reference, from core/enginecore/hookspecs.py: each hook's
signature and docstring, under the section comments of the specs file, with the component
kind each registration hook fills (enginecore.component_kinds).

Run ``python docs/gen_hook_reference.py`` after changing a hook spec; a test fails while the
page is stale.
"""

from __future__ import annotations

import inspect
import re
import sys
from pathlib import Path

from enginecore import hookspecs
from enginecore.component_kinds import COMPONENT_KINDS

PAGE = Path(__file__).with_name("hooks.md")
SECTION = re.compile(r"^# --- (.+?) -+$")


def _hooks() -> list[tuple[int, str, object]]:
    """(source line, name, function) of every hook spec, in file order."""
    marker = f"{hookspecs.PROJECT_NAME}_spec"
    found = []
    for name, fn in vars(hookspecs).items():
        if callable(fn) and hasattr(fn, marker):
            found.append((inspect.getsourcelines(fn)[1], name, fn))
    return sorted(found, key=lambda item: item[0])


def _sections() -> list[tuple[int, str]]:
    lines = inspect.getsource(hookspecs).splitlines()
    return [(n, m.group(1)) for n, line in enumerate(lines, 1) if (m := SECTION.match(line))]


def _options(fn: object) -> str:
    opts = getattr(fn, f"{hookspecs.PROJECT_NAME}_spec", {}) or {}
    on = [key for key in ("firstresult", "historic") if opts.get(key)]
    return f" ({', '.join(on)})" if on else ""


def _kind_line(name: str) -> str:
    for kind in COMPONENT_KINDS:
        if kind.hook == name:
            parts = [f"Fills the `{kind.name}` registry"]
            if kind.base is not None:
                parts.append(f"entries subclass `enginecore.interfaces.{kind.base.__name__}`")
            if kind.config_key is not None:
                parts.append(f"selected by `{kind.config_key}`")
            return "; ".join(parts) + ".\n\n"
    return ""


def render() -> str:
    out = [
        "# Hook reference\n\n",
        "<!-- Generated from core/enginecore/hookspecs.py by docs/gen_hook_reference.py; "
        "do not edit. -->\n\n",
        inspect.cleandoc(hookspecs.__doc__ or "") + "\n\n",
        "The tutorial and the interfaces are in [plugins.md](plugins.md); enabling, failures,\n"
        "diagnostics and versions in [plugin_operations.md](plugin_operations.md).\n",
    ]
    sections = _sections()
    for line, name, fn in _hooks():
        while sections and sections[0][0] < line:
            out.append(f"\n## {sections.pop(0)[1]}\n")
        signature = str(inspect.signature(fn)).replace("'", "")
        out.append(f"\n### `{name}{signature}`{_options(fn)}\n\n")
        out.append(_kind_line(name))
        out.append(inspect.cleandoc(fn.__doc__ or "") + "\n")
    return "".join(out)


if __name__ == "__main__":
    PAGE.write_text(render())
    sys.stdout.write(f"wrote {PAGE}\n")
