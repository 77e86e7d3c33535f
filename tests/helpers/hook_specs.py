"""Every hook of ``enginecore.hookspecs`` with its argument names, as pluggy reads them."""

from __future__ import annotations

from enginecore.plugins import PluginHost


def hook_specs() -> dict[str, list[str]]:
    """Hook name -> argument names, as pluggy reads them from the spec module."""
    host = PluginHost()
    specs = {}
    for name in dir(host.pm.hook):
        caller = getattr(host.pm.hook, name)
        spec = getattr(caller, "spec", None)
        if spec is not None:
            specs[name] = list(spec.argnames)
    return specs


HOOKS = hook_specs()
