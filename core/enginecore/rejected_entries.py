"""Registrations dropped when they were added: recorded on their plugin and warned once.

The registry (:mod:`enginecore.registration_check`) drops an entry its kind cannot use;
this names it against the plugin that registered it, so ``enginecore plugins`` lists it,
``--check`` fails on it and the load warning names the plugin and its distribution.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

logger = logging.getLogger("enginecore.plugins")


def report_rejected(records: Mapping[str, Any], registries: Mapping[str, Any]) -> None:
    """Fill each record's ``rejected`` from the registries; warn about each entry once."""
    from enginecore.plugins import WARNED_ENV_VAR, _env_list

    for record in records.values():
        record.rejected = {}
    warned = set(_env_list(WARNED_ENV_VAR) or [])
    before = len(warned)
    for kind, registry in registries.items():
        for plugin, name, problem in registry.rejected:
            record = records.get(plugin)
            if record is None:
                continue
            key = f"{kind} {name!r}"
            record.rejected[key] = problem
            marker = f"{plugin}/{kind}/{name}"
            if marker in warned:
                continue
            warned.add(marker)
            logger.warning(
                "enginecore plugin %s registered %s, which is dropped: %s. The plugin's "
                "other components are unaffected; 'enginecore plugins --check' lists it.",
                record.describe(),
                key,
                problem,
            )
    if len(warned) != before:
        os.environ[WARNED_ENV_VAR] = ",".join(sorted(warned))
