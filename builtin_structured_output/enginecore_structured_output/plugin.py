"""Registers the built-in grammar backend through the public hook.

``trylast`` so the built-in registers first; a plugin may replace it explicitly with
``override=True`` or register another name and select it with
``structured_output.backend``.
"""

from __future__ import annotations

from typing import Any

from enginecore.hookspecs import hookimpl
from enginecore.registry import Registry


@hookimpl(trylast=True)
def register_structured_output_backends(registry: Registry[Any]) -> None:
    registry.add(
        "xgrammar",
        "enginecore_structured_output.xgrammar_backend:XgrammarBackend",
        summary="xgrammar: JSON schema, any JSON object, regex, choice and EBNF grammars",
    )
